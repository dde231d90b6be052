"""Generator/trainer mismatch corrections (`correction=`): per-token weights and masks from pi_old / pi_generator."""

from gpo.corrections import icepop, mis, none, tis  # noqa: F401

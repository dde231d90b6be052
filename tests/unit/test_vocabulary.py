"""One concept, one name (docs/architecture.md, glossary): the names each concept had before it got its one name
must not come back in any .py or .md file of the repository. A hit fails with file:line.

The retired words are assembled from pieces below, so this file never names them itself."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kit import REPO

# what .gitignore leaves out (run outputs, build products), and every hidden folder (.git, .venv, caches)
SKIP_DIRS = {"__pycache__", "gpo.egg-info", "build", "dist", "runs", "mlruns", "wheels"}


def _word(*pieces: str) -> str:
    """The name on its own or inside a longer identifier (`test_select_carries_<name>`), not as the start of another
    word (a name that only starts with a retired one is another name)."""
    return r"(?<![A-Za-z0-9])" + "".join(pieces) + r"(?![A-Za-z0-9])"


# retired name -> what replaced it
RETIRED = {
    # the generator's log-probs: `generator_logprobs` (field, method, parameter), pi_generator in maths text
    _word("sampler", "_logprobs"): "generator_logprobs",
    _word("sampled", "_logprobs"): "generator_logprobs",
    _word("generator", "_logp"): "generator_logprobs",
    _word("pi", "_gen"): "pi_generator",
    _word("pi", "_infer"): "pi_generator",
    _word("pi", "_behav"): "pi_generator",
    _word("pi", "_sampler"): "pi_generator",
    # pi_old's log-probs: `old_logprobs`; the proximal policy is pi_old
    _word("trainer", "_logp"): "old_logprobs",
    _word("pi", "_train"): "pi_old",
    _word("pi", "_prox"): "pi_old",
    # `keep` is the pruner's alone: the correction's token mask and the group filter's verdict have their own names
    _word("is", "_keep"): "is_mask",
    _word("group", "_keep"): "group_mask",
    # a run's parts: `gpo.build.Parts` from `gpo.build.build_parts`; `gpo.registry.build` builds one component
    _word("Com", "ponents") + r"(?!\*\*)": "gpo.build.Parts (the layer heading `Components**` is another thing)",
    r"gpo\.build\.build" + r"\b(?!_)": "gpo.build.build_parts",
    r"from gpo\.build import (?:.*[ ,])?build" + r"\b(?!_)": "build_parts",
    # a single letter of the glossary meaning something else
    r"^\s*P = " + r"(?!.*\brate\b)": "a named variable (P is the pruning rate)",
}

# "pass rate" is selection's term (the share of candidates a selector expects to reach a whole group); the share of a
# question's completions that pass is the success rate. Prose is selection's where the line says so.
PASS_RATE = re.compile(r"pass[ -]" + "rate", re.IGNORECASE)
SELECTION_CONTEXT = re.compile(r"select|allocator|expect|candidate|\*\*pass rate\*\*", re.IGNORECASE)
PASS_RATE_METRIC = re.compile(r"(?<!select)/pass_" + "rate")  # a metric of that name outside select/


def _files() -> list[Path]:
    out = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        out += [Path(root) / f for f in sorted(files) if f.endswith((".py", ".md"))]
    return out


def retired_names(path: Path) -> list[str]:
    """`file:line: retired -> replacement` for each retired name in `path`."""
    hits = []
    where = path.relative_to(REPO)
    patterns = [(re.compile(p, re.MULTILINE if p.startswith("^") else 0), new) for p, new in RETIRED.items()]
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        for pattern, new in patterns:
            if pattern.search(line):
                hits.append(f"{where}:{number}: `{pattern.search(line).group(0)}` (use {new})")
        if PASS_RATE.search(line) and not SELECTION_CONTEXT.search(line):
            hits.append(f"{where}:{number}: `pass rate` outside selection (a question's share: success rate)")
        if PASS_RATE_METRIC.search(line):
            hits.append(f"{where}:{number}: a `pass_rate` metric outside select/ (success_rate)")
    return hits


def test_no_retired_name_is_used_anywhere():
    files = _files()
    assert any(f.name == "architecture.md" for f in files) and any(f.name == "types.py" for f in files)
    hits = [hit for f in files for hit in retired_names(f)]
    assert not hits, "retired names (docs/architecture.md, glossary):\n" + "\n".join(hits)


def test_the_check_finds_a_retired_name_it_is_given(tmp_path, monkeypatch):
    # Each retired name, written into a file, is reported with its line; the replacements are not.
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    lines = [
        "batch." + "sampler" + "_logprobs = None",
        "def correct(self, " + "trainer" + "_logp, generator_logprobs, loss_mask):",
        "ratio = pi_old / " + "pi" + "_gen",
        "mask = out." + "is" + "_keep",
        "from gpo.build " + "import " + "Com" + "ponents, build",
        "    P = self.parts",
        "Screening keeps questions whose pass " + "rate lies strictly between 0 and 1.",
        'metrics["reward/pass_' + 'rate"] = 0.5',
        "def test_select_carries_" + "sampler" + "_logprobs():",
        "ok: generator_logprobs, old_logprobs, is_mask, group_mask, build_parts, Parts, pi_generator, this_keep",
        "ok: the selector's pass " + "rate, select/pass_" + "rate, P = G * rate",
    ]
    probe = tmp_path / "probe.py"
    probe.write_text("\n".join(lines) + "\n")
    hits = retired_names(probe)
    flagged = sorted({int(h.split(":")[1]) for h in hits})
    assert flagged == [1, 2, 3, 4, 5, 6, 7, 8, 9], hits
    assert all(h.startswith("probe.py:") for h in hits)

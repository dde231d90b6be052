"""Allocators (`allocator=`): how many questions a step draws, and refills of empty slots."""

from gpo.allocators import dynamic, static  # noqa: F401

"""The examples the README points to load: their module-level code (tool lists, prompts, programs)
runs against the package's current API. Running them whole needs the embedded model and minutes;
`scripts/demo.sh` runs the quickstart."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_loads_and_has_a_main(path: Path):
    namespace = runpy.run_path(str(path), run_name="example")  # not "__main__": nothing runs a model
    assert callable(namespace.get("main")), f"{path.name} has no main()"


def test_the_tool_fanout_example_reads_back_and_runs_a_call():
    """What its program does between the model's calls (a removed parser method broke it)."""
    example = runpy.run_path(str(EXAMPLES[0].parent / "tool_fanout.py"), run_name="example")
    assert example["run_call"]("restaurants", '{"city": "Lisbon", "budget": "low"}') == (
        "Lisbon (low): grilled fish by the river"
    )

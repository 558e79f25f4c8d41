"""SGLang's module names in radixrt's frontend.

SGLang programs import from SGLang's modules (``from sglang.lang.ir import
REGEX_INT``), and run against radixrt with ``sglang.lang.X`` bound to
``radixrt.frontend.X``. Every public name of SGLang's ``lang/api.py``,
``lang/ir.py``, ``lang/choices.py`` and ``lang/interpreter.py`` must be
importable from our module of the same role. The lists below are those of
SGLang 0.5.10.post1 and 0.5.23 (the same in both); where SGLang's client is
installed, they are checked to still cover its modules.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import radixrt.frontend as rt
from radixrt.frontend import api, interpreter, ir
from radixrt.frontend.errors import UnsupportedModalityError
from radixrt.frontend.function import SglFunction
from radixrt.frontend.program_state import ProgramState
from radixrt.frontend.sampling_params import default_sampling_params
from tests.unit.test_frontend_unit import ScriptedBackend

_IR_NODES = [
    "SglExpr",
    "SglExprList",
    "SglGen",
    "SglImage",
    "SglRoleBegin",
    "SglRoleEnd",
    "SglSelect",
    "SglSeparateReasoning",
    "SglVideo",
]

SGLANG_NAMES = {
    "api": [
        "global_config",
        "BaseBackend",
        "ChoicesSamplingMethod",
        "token_length_normalized",
        "SglFunction",
        *_IR_NODES,
        "function",
        "Runtime",
        "Engine",
        "set_default_backend",
        "flush_cache",
        "get_server_info",
        "gen",
        "gen_int",
        "gen_string",
        "image",
        "video",
        "select",
        "system",
        "user",
        "assistant",
        "system_begin",
        "system_end",
        "user_begin",
        "user_end",
        "assistant_begin",
        "assistant_end",
        "separate_reasoning",
    ],
    "ir": [
        "global_config",
        "ChoicesSamplingMethod",
        "REGEX_INT",
        "REGEX_FLOAT",
        "REGEX_BOOL",
        "REGEX_STR",
        "SglSamplingParams",
        "SglFunction",
        *_IR_NODES,
        "SglArgument",
        "SglConstantText",
        "SglFork",
        "SglGetForkItem",
        "SglVariable",
        "SglVarScopeBegin",
        "SglVarScopeEnd",
        "SglConcateAndAppend",
        "SglCommitLazy",
    ],
    "choices": [
        "ChoicesDecision",
        "ChoicesSamplingMethod",
        "TokenLengthNormalized",
        "token_length_normalized",
        "GreedyTokenSelection",
        "greedy_token_selection",
        "UnconditionalLikelihoodNormalized",
        "unconditional_likelihood_normalized",
    ],
    "interpreter": [
        "global_config",
        *_IR_NODES,
        "SglCommitLazy",
        "SglConcateAndAppend",
        "SglConstantText",
        "SglVariable",
        "SglVarScopeBegin",
        "SglVarScopeEnd",
        "encode_image_base64",
        "encode_video_base64",
        "get_exception_traceback",
        "run_internal",
        "run_program",
        "run_program_batch",
        "cache_program",
        "StreamExecutor",
        "ProgramState",
        "ProgramStateGroup",
    ],
}


@pytest.mark.parametrize("module", sorted(SGLANG_NAMES))
def test_every_sglang_name_is_importable_from_our_module(module):
    missing = []
    for name in SGLANG_NAMES[module]:
        scope: dict = {}
        try:  # the import statement itself: module-level __getattr__ names included
            exec(f"from radixrt.frontend.{module} import {name}", scope)
        except ImportError:
            missing.append(name)
            continue
        assert scope[name] is not None, name
    assert missing == [], f"radixrt.frontend.{module} lacks SGLang's {missing}"


def _public_names(path: Path) -> set[str]:
    """Names a module defines or takes from SGLang's own modules, without the private ones."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                names.update(e.id for e in elts if isinstance(e, ast.Name))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            names.update(a.asname or a.name for a in node.names)
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("module", sorted(SGLANG_NAMES))
def test_the_lists_cover_the_installed_sglang(module):
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it (it loads torch)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang's client is not installed (scripts/setup.sh installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / "lang" / f"{module}.py"
    assert sorted(_public_names(path) - set(SGLANG_NAMES[module])) == []


def test_aliases_are_our_equivalents():
    from radixrt.frontend.sampling_params import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

    assert (ir.REGEX_INT, ir.REGEX_FLOAT, ir.REGEX_BOOL, ir.REGEX_STR) == (
        REGEX_INT,
        REGEX_FLOAT,
        REGEX_BOOL,
        REGEX_STR,
    )
    assert re.fullmatch(ir.REGEX_INT, "-42") and re.fullmatch(ir.REGEX_FLOAT, "2.5")
    assert re.fullmatch(ir.REGEX_STR, '"Paris"') and re.fullmatch(ir.REGEX_BOOL, "True")
    assert ir.SglFunction is api.SglFunction is SglFunction
    assert api.global_config is ir.global_config is interpreter.global_config is rt.global_config
    assert api.BaseBackend is rt.BaseBackend
    assert interpreter.SglGen is ir.SglGen and interpreter.ProgramState is ProgramState
    from radixrt.engine import Engine
    from radixrt.frontend.runtime_endpoint import Runtime

    assert api.Engine is Engine and api.Runtime is Runtime
    with pytest.raises(AttributeError):
        api.NoSuchName  # noqa: B018 - the attribute access is the test
    with pytest.raises(AttributeError):
        ir.NoSuchName  # noqa: B018


def test_cache_program_prefills_the_constant_prefix():
    be = ScriptedBackend()
    prefix = "You are a careful assistant. Answer briefly.\n"

    @rt.function
    def prog(s, question):
        s += prefix
        s += "Q: " + question + "\nA:" + rt.gen("a", max_tokens=4)

    assert interpreter.cache_program(prog, be) == prefix + "Q: "
    assert be.prefills == [prefix + "Q: "]
    assert be.requests == []  # traced: nothing was generated
    assert prog.cache(be) == prefix + "Q: " and len(be.prefills) == 2

    @rt.function
    def short(s):
        s += "Hi" + rt.gen("a")

    assert interpreter.cache_program(short, be) == "Hi" and len(be.prefills) == 2  # too short to prefill


def test_run_internal_runs_a_body_on_a_state():
    be = ScriptedBackend(reply=lambda p, sp: "ok")

    @rt.function
    def prog(s, name, punct="!"):
        s += "Hello " + name + punct + rt.gen("g")

    state = ProgramState(interpreter.StreamExecutor(be, {}, default_sampling_params(), stream=False))
    interpreter.run_internal(state, prog, ["Ann"], {"punct": "?"}, sync=True)
    assert state.text() == "Hello Ann?ok" and state["g"] == "ok"


def test_sglang_internals_say_what_they_cannot_do():
    with pytest.raises(NotImplementedError, match="SglFork"):
        ir.SglGetForkItem(None, 0)
    with pytest.raises(UnsupportedModalityError, match="text-only"):
        interpreter.encode_image_base64("cat.png")
    with pytest.raises(UnsupportedModalityError, match="text-only"):
        interpreter.encode_video_base64("cat.mp4", 4)
    try:
        raise ValueError("boom")
    except ValueError:
        tb = interpreter.get_exception_traceback()
    assert "ValueError: boom" in tb and "Traceback" in tb


def test_concate_and_append_is_a_node_sglang_programs_can_build():
    be = ScriptedBackend(reply=lambda p, sp: "!")

    @rt.function
    def prog(s):
        s += "P:"
        forks = s.fork(2)
        forks += lambda i: f"[{i}]" + rt.gen("g")
        forks.join()
        s += ir.SglConcateAndAppend(list(forks))  # what join("concate_and_append") appends

    assert prog.run(backend=be).text() == "P:[0]![1]!"
    assert importlib.import_module("radixrt.frontend.ir").SglConcateAndAppend is interpreter.SglConcateAndAppend

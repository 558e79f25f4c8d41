"""What each expression does to a program state.

:func:`execute` runs one expression against a stream executor (``ex``, see
``executor.py``): constant text is appended; ``gen`` sends the text so far
to the backend and appends the completion (storing it in its variable);
``select`` asks the backend to score the choices and appends the winner;
role brackets render chat turns (``roles.py``); variable scopes store the
text appended between their begin and end. In a traced run (``ex.tracer``
set) ``gen``/``select`` never reach a backend: the tracer records them and
supplies placeholders.

Contract: called only from the executor's worker (one expression at a
time per state); it raises on any failure and leaves recording the error
to the caller.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from radixrt.requests.reasoning import split_reasoning

from .api_speculation import speculates, speculative_gen
from .constraints import fit_to_constraint
from .errors import FrontendError, UnsupportedModalityError
from .nodes import (
    SglCommitLazy,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglSeparateReasoning,
    SglVarScopeBegin,
    SglVarScopeEnd,
    SglVideo,
)
from .roles import begin_role, end_role
from .sampling_params import SglSamplingParams


def produced_names(expr: SglExpr) -> list[str]:
    """The variables executing ``expr`` sets (named ``gen``/``select`` and
    variable-scope ends), in order."""
    out = []
    for e in expr.flatten():
        if isinstance(e, (SglGen, SglSelect, SglVarScopeEnd)) and e.name is not None:
            out.append(e.name)
    return out


def check_supported(backend: Any, expr: SglExpr) -> None:
    """Raise ``UnsupportedModalityError`` at once (not on the worker) when
    ``expr`` holds image/video input the backend cannot take."""
    if getattr(backend, "supports_images", False):
        return
    for e in expr.flatten():
        if isinstance(e, (SglImage, SglVideo)):
            kind = "image" if isinstance(e, SglImage) else "video"
            raise UnsupportedModalityError(
                f"{kind} inputs are not supported by this model: radixrt serves text-only models "
                f"(backend {type(backend).__name__})"
            )


def execute(ex: Any, expr: SglExpr) -> None:
    """Run ``expr`` (a list: each of its expressions in order) on ``ex``."""
    if isinstance(expr, SglExprList):
        for e in expr.expr_list:
            execute(ex, e)
        return
    if ex.tracer is not None:
        ex.tracer.record(ex, expr)
    _handler_for(expr)(ex, expr)


def _handler_for(expr: SglExpr) -> Callable[[Any, Any], None]:
    for cls in type(expr).__mro__:
        handler = _HANDLERS.get(cls)
        if handler is not None:
            return handler
    raise TypeError(f"cannot execute {expr!r}")


# --- generation --------------------------------------------------------------------


def _gen(ex: Any, expr: SglGen) -> None:
    sp = expr.sampling.merged_over(ex.default_sampling)
    if ex.tracer is not None:
        ex.tracer.dynamic(ex, expr)
        return
    n = sp.n or 1
    start = len(ex.text_)
    if speculates(ex, sp):
        comp, meta = speculative_gen(ex, sp)
        ex.append(comp, var=expr.name, meta=meta, speculated=True)
    elif ex.stream and n == 1:
        comp, meta = _gen_streamed(ex, sp, expr.name, start)
    else:
        comp, meta = _gen_whole(ex, sp, expr.name, n)
    if n == 1:
        comp = _fit(ex, sp, comp, start, meta)
    ex.store_var(expr.name, comp, meta, has_meta=True)
    ex.mark_var_done(expr.name, meta)


def _gen_streamed(ex: Any, sp: SglSamplingParams, name: Optional[str], start: int) -> tuple[str, Any]:
    """Append the completion chunk by chunk as the backend streams it; the
    final text wins where it differs (e.g. a stop string trimmed at the end)."""
    streamed, final_text, meta = "", "", {}
    for cum_text, meta_so_far in ex.backend.generate_stream(ex, sp):
        final_text, meta = cum_text, meta_so_far
        if cum_text.startswith(streamed) and len(cum_text) > len(streamed):
            ex.append(cum_text[len(streamed) :], var=name, meta=meta_so_far)
            streamed = cum_text
    if final_text != streamed:
        ex.text_ = ex.text_[:start] + final_text
    return final_text, meta


def _gen_whole(ex: Any, sp: SglSamplingParams, name: Optional[str], n: int) -> tuple[Any, Any]:
    """One request; with ``n > 1`` the variable gets every sample and the
    text the first."""
    comp, meta = ex.backend.generate(ex, sp)
    ex.append((comp[0] if comp else "") if n > 1 else comp, var=name, meta=meta)
    return comp, meta


def _fit(ex: Any, sp: SglSamplingParams, comp: str, start: int, meta: Any) -> str:
    """Apply the constraint fallback (``constraints.py``) to the completion
    appended at ``start``; returns the variable's value."""
    fitted = fit_to_constraint(sp, comp)
    if fitted.text != comp:
        ex.text_ = ex.text_[:start] + fitted.text
    if fitted.flags and isinstance(meta, dict):
        meta.update(fitted.flags)
    return fitted.value


def _select(ex: Any, expr: SglSelect) -> None:
    if ex.tracer is not None:
        ex.tracer.dynamic(ex, expr)
        return
    adapter = {} if expr.lora is None else {"lora": expr.lora}  # a backend of SGLang's signature takes none
    decision = ex.backend.select(ex, expr.choices, expr.temperature, expr.choices_method, **adapter)
    ex.append(decision.decision, var=expr.name, meta=decision.meta_info)
    ex.store_var(expr.name, decision.decision, decision.meta_info, has_meta=True)
    ex.mark_var_done(expr.name, decision.meta_info)


# --- everything else ------------------------------------------------------------------


def _var_scope_begin(ex: Any, expr: SglVarScopeBegin) -> None:
    ex.var_scope_begin[expr.name] = len(ex.text_)


def _var_scope_end(ex: Any, expr: SglVarScopeEnd) -> None:
    if expr.name not in ex.var_scope_begin:
        raise FrontendError(f"var_scope {expr.name!r} ended without beginning")
    ex.store_var(expr.name, ex.text_[ex.var_scope_begin.pop(expr.name) :])


def _commit_lazy(ex: Any, expr: SglCommitLazy) -> None:
    if ex.tracer is None and ex.text_:
        ex.backend.cache_prefix(ex.text_)


def _concate_and_append(ex: Any, expr: SglConcateAndAppend) -> None:
    """Append what each joined branch added since its fork, in branch order."""
    ex.append("".join(st.stream_executor.text_[st.stream_executor.fork_start_text_pos :] for st in expr.states))


def _separate_reasoning(ex: Any, expr: SglSeparateReasoning) -> None:
    """Split each named variable into its thinking block (``<name>_reasoning_content``) and the
    rest (the variable), and drop the block from the text where the variable ends it, as
    SGLang's interpreter does; not while streaming (SGLang's neither: it was already sent)."""
    if ex.stream:
        return
    for name in expr.names:
        value = ex.variables.get(name)
        if not isinstance(value, str):
            continue
        reasoning, content = split_reasoning(value, opened_by_prompt=expr.model_type == "deepseek-r1")
        ex.store_var(name, content)
        ex.store_var(name + "_reasoning_content", reasoning)
        if ex.text_.endswith(value):
            ex.text_ = ex.text_[: len(ex.text_) - len(value)] + content


def _unsupported_modality(ex: Any, expr: SglExpr) -> None:
    raise UnsupportedModalityError("image/video inputs are not supported by this model")


_HANDLERS: dict[type, Callable[[Any, Any], None]] = {
    SglConstantText: lambda ex, e: ex.append(e.value),
    SglGen: _gen,
    SglSelect: _select,
    SglRoleBegin: lambda ex, e: begin_role(ex, e.role),
    SglRoleEnd: lambda ex, e: end_role(ex, e.role),
    SglVarScopeBegin: _var_scope_begin,
    SglVarScopeEnd: _var_scope_end,
    SglCommitLazy: _commit_lazy,
    SglConcateAndAppend: _concate_and_append,
    SglSeparateReasoning: _separate_reasoning,
    SglImage: _unsupported_modality,
    SglVideo: _unsupported_modality,
}

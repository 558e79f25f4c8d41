"""Chat role markers derived from a tokenizer's own chat template.

The frontend renders ``system``/``user``/``assistant`` blocks as plain text:
``prefix + content + suffix``. To make that text identical to what the model's
chat template produces (and so to what the OpenAI chat route sends, which
keeps prefixes shareable in the radix cache), each role's prefix and suffix are
read off the template itself: render tiny conversations whose contents are
sentinel strings, then cut around the sentinels.

Templates differ in what they put around a message:

* ChatML (SmolLM2, Qwen): ``<|im_start|>user\\n`` ... ``<|im_end|>\\n``;
* some inject a default system prompt when the conversation has no system
  message (SmolLM2 does: "You are a helpful AI assistant named SmolLM...");
  that block is reported by :func:`derive_default_system_prompt` and is *not*
  folded into the user prefix;
* some reject a system role or require user/assistant alternation; a role the
  template cannot render falls back to the plain markers.

This module imports nothing heavy: the tokenizer is passed in.
"""

from __future__ import annotations

from typing import Any, Optional

ROLES = ("system", "user", "assistant")

# Used when the tokenizer has no chat template (or it cannot be rendered).
PLAIN_ROLE_MARKERS: dict[str, tuple[str, str]] = {
    "system": ("System: ", "\n"),
    "user": ("User: ", "\n"),
    "assistant": ("Assistant: ", "\n"),
}

_S = "\u2063SYSTEM-CONTENT-7f3a\u2063"
_U = "\u2063USER-CONTENT-5c1e\u2063"
_A = "\u2063ASSISTANT-CONTENT-9b2d\u2063"
_U2 = "\u2063USER-CONTENT-2-4e8f\u2063"


def _render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False) -> str:
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(out, str):  # some versions return a list for batched input
        raise TypeError("apply_chat_template did not return a string")
    return out


def _has_template(tokenizer: Any) -> bool:
    return (
        tokenizer is not None
        and bool(getattr(tokenizer, "chat_template", None))
        and hasattr(tokenizer, "apply_chat_template")
    )


def _auto_bos_text(tokenizer: Any) -> str:
    """The BOS token text when encoding adds it automatically (it must then
    not appear again inside the rendered text), else ""."""
    bos = getattr(tokenizer, "bos_token", None)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    try:
        ids = tokenizer.encode("x")
    except Exception:
        return ""
    return bos if ids and ids[0] == bos_id else ""


def _strip_bos(text: str, bos: str) -> str:
    if bos and text.startswith(bos):
        return text[len(bos) :]
    return text


class _Parts:
    """Pieces of the template read off sentinel renderings."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.bos = _auto_bos_text(tokenizer)
        self.markers: dict[str, tuple[str, str]] = {}
        self.default_system_prompt: Optional[str] = None
        self._derive()

    def _derive(self) -> None:
        # user: [user U] alone -> <default system block?> + user_prefix + U + user_suffix
        only_user = self._render([{"role": "user", "content": _U}])
        before_u, user_suffix = only_user.split(_U, 1)
        sys_prefix, sys_suffix = self._system_markers()
        user_prefix = self._user_prefix_after_system(sys_prefix, sys_suffix)
        if user_prefix is None:
            user_prefix = self._user_prefix_between_turns(before_u)

        # default system block: what precedes the user prefix in [user U] alone
        default_block = before_u[: len(before_u) - len(user_prefix)] if before_u.endswith(user_prefix) else ""
        if (
            default_block
            and sys_prefix is not None
            and sys_suffix is not None
            and default_block.startswith(sys_prefix)
            and default_block.endswith(sys_suffix)
        ):
            content = default_block[len(sys_prefix) : len(default_block) - len(sys_suffix)]
            self.default_system_prompt = content or None

        asst_prefix, asst_suffix = self._assistant_markers(user_suffix)
        self.markers["user"] = (user_prefix, user_suffix)
        self.markers["system"] = (
            (sys_prefix, sys_suffix)
            if sys_prefix is not None and sys_suffix is not None
            else PLAIN_ROLE_MARKERS["system"]
        )
        # (the generation prompt alone may give a prefix when [user, assistant] did not render)
        self.markers["assistant"] = (
            (asst_prefix, asst_suffix)
            if asst_prefix is not None and asst_suffix is not None
            else PLAIN_ROLE_MARKERS["assistant"]
        )

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return _strip_bos(_render(self.tok, messages, add_generation_prompt), self.bos)

    def _system_markers(self) -> tuple[Optional[str], Optional[str]]:
        """[system S] alone -> system_prefix + S + system_suffix; (None, None) when
        the template cannot render a lone system message."""
        try:
            only_sys = self._render([{"role": "system", "content": _S}])
            if only_sys.count(_S) == 1:
                sys_prefix, sys_suffix = only_sys.split(_S, 1)
                return sys_prefix, sys_suffix
        except Exception:
            pass
        return None, None

    def _user_prefix_after_system(self, sys_prefix: Optional[str], sys_suffix: Optional[str]) -> Optional[str]:
        """The user prefix: between S and U in [system S, user U], minus the
        system suffix; None without a usable system role."""
        if sys_prefix is None or sys_suffix is None:
            return None
        try:
            su = self._render([{"role": "system", "content": _S}, {"role": "user", "content": _U}])
            if su.count(_S) == 1 and su.count(_U) == 1 and su.index(_S) < su.index(_U):
                mid = su.split(_S, 1)[1].split(_U, 1)[0]
                if mid.startswith(sys_suffix):
                    return mid[len(sys_suffix) :]
                # the system block might render differently when followed by a turn
                if sys_suffix and mid.startswith(sys_suffix.rstrip()):
                    return mid[len(sys_suffix.rstrip()) :]
        except Exception:
            pass
        return None

    def _user_prefix_between_turns(self, before_u: str) -> str:
        """The user prefix from [user U, assistant A, user U2]: what lies between A
        and U2 is assistant_suffix + user_prefix, so the user prefix is its longest
        tail that also ends ``before_u`` (all of ``before_u`` when that fails)."""
        try:
            conv = self._render(
                [
                    {"role": "user", "content": _U},
                    {"role": "assistant", "content": _A},
                    {"role": "user", "content": _U2},
                ]
            )
            between = conv.split(_A, 1)[1].split(_U2, 1)[0]
            for k in range(len(between), 0, -1):
                tail = between[-k:]
                if before_u.endswith(tail):
                    return tail
        except Exception:
            pass
        return before_u

    def _assistant_markers(self, user_suffix: str) -> tuple[Optional[str], Optional[str]]:
        """[user U, assistant A] -> ... U + user_suffix + asst_prefix + A + asst_suffix;
        the generation prompt, when it renders, gives the prefix (the most
        reliable source)."""
        asst_prefix = asst_suffix = None
        try:
            ua = self._render([{"role": "user", "content": _U}, {"role": "assistant", "content": _A}])
            mid = ua.split(_U, 1)[1].split(_A, 1)[0]
            asst_suffix = ua.split(_A, 1)[1]
            asst_prefix = mid[len(user_suffix) :] if mid.startswith(user_suffix) else mid
        except Exception:
            pass
        try:
            gp = self._render([{"role": "user", "content": _U}], add_generation_prompt=True)
            gen_prompt = gp.split(_U, 1)[1]
            if gen_prompt.startswith(user_suffix) and len(gen_prompt) > len(user_suffix):
                asst_prefix = gen_prompt[len(user_suffix) :]
        except Exception:
            pass
        return asst_prefix, asst_suffix


def derive_role_markers(tokenizer: Any) -> dict[str, tuple[str, str]]:
    """``{"system"|"user"|"assistant": (prefix, suffix)}`` from the tokenizer's
    chat template; :data:`PLAIN_ROLE_MARKERS` when there is none."""
    if not _has_template(tokenizer):
        return dict(PLAIN_ROLE_MARKERS)
    try:
        return dict(_Parts(tokenizer).markers)
    except Exception:
        return dict(PLAIN_ROLE_MARKERS)


def derive_default_system_prompt(tokenizer: Any) -> Optional[str]:
    """The system prompt the template inserts when a conversation has no system
    message (SmolLM2: "You are a helpful AI assistant named SmolLM, trained by
    Hugging Face"), or None."""
    if not _has_template(tokenizer):
        return None
    try:
        return _Parts(tokenizer).default_system_prompt
    except Exception:
        return None


def chat_template_info(tokenizer: Any) -> dict[str, Any]:
    """Both in one JSON-able dict: ``{"chat_role_markers": {...}, "chat_default_system_prompt": str|None}``
    (the shape the server's ``/get_model_info`` carries)."""
    if not _has_template(tokenizer):
        return {"chat_role_markers": dict(PLAIN_ROLE_MARKERS), "chat_default_system_prompt": None}
    try:
        p = _Parts(tokenizer)
        return {"chat_role_markers": dict(p.markers), "chat_default_system_prompt": p.default_system_prompt}
    except Exception:
        return {"chat_role_markers": dict(PLAIN_ROLE_MARKERS), "chat_default_system_prompt": None}


def render_messages(
    messages: list[dict],
    markers: dict[str, tuple[str, str]],
    default_system_prompt: Optional[str] = None,
    add_generation_prompt: bool = False,
) -> str:
    """Render a message list with role markers, the way the frontend does (used
    to check markers against ``apply_chat_template``)."""
    out = []
    if messages and messages[0]["role"] != "system" and default_system_prompt:
        p, s = markers["system"]
        out.append(p + default_system_prompt + s)
    for m in messages:
        p, s = markers[m["role"]]
        out.append(p + m["content"] + s)
    if add_generation_prompt:
        out.append(markers["assistant"][0])
    return "".join(out)

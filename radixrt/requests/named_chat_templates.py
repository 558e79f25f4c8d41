"""Chat templates by name, for ``--chat-template <name>`` (SGLang's flag takes a name of its
registry as well as a file): for models whose tokenizer has no template (base models
fine-tuned on one of these formats), written as Jinja templates that render what the
format's reference implementation writes. ``bos_token`` and ``eos_token`` are the
tokenizer's, as transformers passes them to every template."""

from __future__ import annotations

_VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)

# ChatML (OpenAI's; Qwen, SmolLM and many fine-tunes): every turn in <|im_start|> ... <|im_end|>
_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3 Instruct (Meta's template, whose turns are trimmed)
_LLAMA_3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Llama 2 Chat (Meta's): the system prompt inside the first [INST] between <<SYS>> markers
_LLAMA_2 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system is not none %}"
    "{%- set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{%- else %}{%- set content = message['content'] %}{%- endif %}"
    "{{- bos_token + '[INST] ' + content | trim + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# Vicuna v1.1 (FastChat's): "<system> USER: ... ASSISTANT: ...</s>USER: ..."
_VICUNA = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = '" + _VICUNA_SYSTEM.replace("'", "\\'") + "' %}{%- set turns = messages %}"
    "{%- endif %}"
    "{{- system + ' ' }}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'user' %}{{- 'USER: ' + message['content'] + ' ' }}"
    "{%- elif message['role'] == 'assistant' %}{{- 'ASSISTANT: ' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"
)

# name -> template; SGLang's names (and the spellings of its two registries where they differ)
NAMED_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "llama-3-instruct": _LLAMA_3,
    "llama-2": _LLAMA_2,
    "llama-2-chat": _LLAMA_2,
    "vicuna_v1.1": _VICUNA,
}

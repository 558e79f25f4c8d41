#!/usr/bin/env python3
"""Package FlashInfer for the GPU machine, which has no network and takes at most
64 MiB of carried files per call.

The flashinfer-python wheel is ~100 MB (~700 MB unpacked) and JIT-compiles its
kernels with nvcc on first use (minutes of device time). This script, run on a
CPU machine that has pip access and CUDA's nvcc (no GPU needed):

1. downloads flashinfer-python (pinned) and apache-tvm-ffi (its only compiled
   dependency the GPU image lacks; the device's cp312 build) with
   ``pip download --no-deps``;
2. compiles ahead of time, for sm_90a (H100/H200), the kernels radixrt uses:
   batch decode and batch prefill (fa2) for bf16, head_dim 64 and 128, and the
   sampling kernels. FlashInfer loads a module from
   ``flashinfer/data/aot/<name>/<name>.so`` without compiling when that file
   exists, so no device time goes to nvcc (a stub libcuda.so stands in for the
   driver at link time; the kernels link against libcudart.so.13, which the
   device's CUDA 13 torch provides);
3. trims the package to what importing it and running those kernels needs:
   every Python file, small data files, the csrc templates the module
   generators read, and exactly the headers the compiled modules included
   (so a JIT fallback on the device can still rebuild them); the rest (prebuilt
   kernels of other features, CUTLASS, ...) is dropped;
4. writes ``site/`` (flashinfer + tvm_ffi) and ``runtime/`` (the device's builds of
   pyzmq and msgspec, which radixrt needs and the GPU image lacks) as one .tar.xz, split into parts of
   at most ``--max-part-mib`` (60) MiB, plus the default model's config and
   tokenizer (for building its shapes with random weights on the device), into
   ``--out`` (default ``.device_carry/``, git-ignored), with a manifest.

Device side: ``python scripts/device/gpu_check.py`` (its ``install_flashinfer``,
or ``--install-only``) reassembles and unpacks it into /tmp/radixrt_site; see
scripts/device/run_on_gpu.md.

    python scripts/device/pack_flashinfer.py               # full build (~15 min on 1 core)
    python scripts/device/pack_flashinfer.py --no-aot      # package only (device JIT-compiles)
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLASHINFER_VERSION = "0.7.4"
DEVICE_PYTHON = "3.12"
DEVICE_PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# radixrt's compiled dependencies the device's image lacks (carried in site/ beside flashinfer)
DEVICE_RUNTIME_DEPS = ["pyzmq>=25,<28", "msgspec>=0.18,<1"]
# pure-Python helpers flashinfer imports that the host venv may lack (only used here, to run the AOT build)
HOST_HELPERS = ["nvidia-ml-py", "einops", "tabulate", "ninja"]
SMALL_FILE = 256 * 1024  # non-Python files kept outside data/ when smaller than this
CSRC_SMALL = 200 * 1024  # top-level csrc templates/sources kept when smaller than this
DEFAULT_MODEL_META = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)

AOT_BUILDER = r"""
import json, sys, time, torch
from flashinfer.jit.attention import modules as m
from flashinfer.jit.sampling import gen_sampling_module
# fa2 prefill loads its "primary" module (equal KV strides, ``..._kv_stride_equal``) since 0.7;
# gen_batch_prefill_module names the runtime-stride module, which no wrapper asks for
prefill = getattr(m, "_gen_batch_prefill_primary_module", m.gen_batch_prefill_module)
head_dims = [int(x) for x in sys.argv[1].split(",") if x]
with_sampling = sys.argv[2] == "1"
fp8_head_dims = [int(x) for x in sys.argv[3].split(",") if x] if len(sys.argv) > 3 else []
bf = torch.bfloat16
specs = []
for hd in head_dims:
    specs.append(m.gen_batch_decode_module(bf, bf, bf, torch.int32, hd, hd, 0, False, False))
    specs.append(prefill("fa2", bf, bf, bf, torch.int32, hd, hd, 0, False, False, False))
for hd in fp8_head_dims:  # kv_cache_dtype fp8_e4m3 / fp8_e5m2 (bf16 queries and outputs)
    for kv in (torch.float8_e4m3fn, torch.float8_e5m2):
        specs.append(m.gen_batch_decode_module(bf, kv, bf, torch.int32, hd, hd, 0, False, False))
        specs.append(prefill("fa2", bf, kv, bf, torch.int32, hd, hd, 0, False, False, False))
if with_sampling:
    specs.append(gen_sampling_module())
for spec in specs:
    t = time.time()
    spec.build()
    print(json.dumps({"name": spec.name, "so": str(spec.jit_library_path), "build_dir": str(spec.build_dir),
                      "seconds": round(time.time() - t, 1)}), flush=True)
"""

VERIFY = r"""
import sys, torch, flashinfer
from flashinfer.jit.attention import modules as m
from flashinfer.jit.sampling import gen_sampling_module
prefill = getattr(m, "_gen_batch_prefill_primary_module", m.gen_batch_prefill_module)
names = set(sys.argv[1].split(",")) if sys.argv[1] else set()
bf = torch.bfloat16
found = {}
for hd in (64, 128):
    for kv in (bf, torch.float8_e4m3fn, torch.float8_e5m2):
        for spec in (m.gen_batch_decode_module(bf, kv, bf, torch.int32, hd, hd, 0, False, False),
                     prefill("fa2", bf, kv, bf, torch.int32, hd, hd, 0, False, False, False)):
            found[spec.name] = spec.is_aot
s = gen_sampling_module(); found[s.name] = s.is_aot
missing = [n for n in names if not found.get(n)]
assert not missing, f"AOT modules not found by flashinfer: {missing}"
assert flashinfer.BatchDecodeWithPagedKVCacheWrapper and flashinfer.BatchPrefillWithPagedKVCacheWrapper
print("flashinfer", flashinfer.__version__, "imports; AOT modules found:", sum(found.values()))
"""


def log(msg: str) -> None:
    print(f"[pack] {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def pip_download(dest: Path, specs: list[str], device: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest]
    if device:
        cmd += ["--only-binary=:all:", "--python-version", DEVICE_PYTHON, "--implementation", "cp"]
        for p in DEVICE_PLATFORMS:
            cmd += ["--platform", p]
    run(cmd + specs)


def one(pattern: str) -> Path:
    hits = sorted(glob.glob(pattern))
    if len(hits) != 1:
        raise SystemExit(f"expected one file for {pattern}, found {hits}")
    return Path(hits[0])


def wheel_requirement(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                req = line.split(":", 1)[1].strip()
                if req.split("<")[0].split(">")[0].split("=")[0].split(";")[0].strip() == name:
                    return req.split(";")[0].replace(" ", "")
    raise SystemExit(f"{wheel.name} does not require {name}")


def unpack(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)
    # zipfile drops permission bits; executables (ninja) need them back
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            mode = info.external_attr >> 16
            if mode & 0o111:
                os.chmod(dest / info.filename, mode & 0o777)


def libcuda_stub(work: Path) -> Path:
    """An empty libcuda.so (soname libcuda.so.1) for linking on a machine without the driver."""
    stub_dir = work / "stubs"
    stub = stub_dir / "libcuda.so"
    if not stub.exists():
        stub_dir.mkdir(parents=True, exist_ok=True)
        src = stub_dir / "stub.c"
        src.write_text("void radixrt_libcuda_link_stub(void) {}\n")
        run(["cc", "-shared", "-o", stub, src, "-Wl,-soname,libcuda.so.1"])
    return stub_dir


def find_cuda_home() -> str:
    versioned = sorted(glob.glob("/usr/local/cuda-*"))[::-1]
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda", *versioned):
        if cand and Path(cand, "bin", "nvcc").exists():
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        if real.name == "nvcc" and real.parent.name == "bin":
            return str(real.parent.parent)
        for line in Path(nvcc).read_text(errors="ignore").splitlines():  # a wrapper script: exec /path/bin/nvcc
            for tok in line.split():
                if tok.endswith("/bin/nvcc") and Path(tok).exists():
                    return str(Path(tok).parent.parent)
    raise SystemExit("nvcc not found: set CUDA_HOME, or pass --no-aot (the device then JIT-compiles)")


def cuda_home_with_curand(work: Path, cuda_home: str) -> str:
    """FlashInfer's sampling kernels include curand's device headers, which a
    minimal CUDA install may lack. Then: an overlay CUDA_HOME whose include/ adds
    the headers of the nvidia-curand wheel (cu13) to links to everything else."""
    if Path(cuda_home, "include", "curand_kernel.h").exists():
        return cuda_home
    overlay = work / "cuda-overlay"
    if not (overlay / "include" / "curand_kernel.h").exists():
        wheels = work / "wheels-curand"
        wheels.mkdir(parents=True, exist_ok=True)
        if not glob.glob(str(wheels / "nvidia_curand-*.whl")):
            pip_download(wheels, ["nvidia-curand>=10.4,<11"], device=False)
        shutil.rmtree(overlay, ignore_errors=True)
        (overlay / "include").mkdir(parents=True)
        for entry in Path(cuda_home).iterdir():
            if entry.name != "include":
                (overlay / entry.name).symlink_to(entry)
        for entry in Path(cuda_home, "include").iterdir():
            (overlay / "include" / entry.name).symlink_to(entry)
        with zipfile.ZipFile(one(str(wheels / "nvidia_curand-*.whl"))) as z:
            for name in z.namelist():
                if "/include/" in name and name.endswith(".h"):
                    (overlay / "include" / Path(name).name).write_bytes(z.read(name))
        log(f"curand headers missing from {cuda_home}: using the overlay {overlay}")
    return str(overlay)


def aot_build(
    work: Path,
    site: Path,
    host_site: Path,
    head_dims: list[int],
    fp8_head_dims: list[int],
    sampling: bool,
    jobs: int,
    arch: str,
) -> list[dict]:
    cuda_home = find_cuda_home()
    builder = work / "aot_build.py"
    builder.write_text(AOT_BUILDER)
    log(
        f"AOT-compiling for sm_{arch} (head dims {head_dims}, fp8 KV at {fp8_head_dims}, sampling={sampling}, "
        f"{jobs} job(s)); "
        "decode ~1 min, prefill ~4-8 min, sampling a few min per core"
    )
    built = []
    # the attention modules with the plain CUDA_HOME; sampling possibly with the curand overlay
    # (a changed CUDA_HOME changes the build commands, and ninja would rebuild everything)
    runs = [(",".join(map(str, head_dims)), "0", ",".join(map(str, fp8_head_dims)), cuda_home)]
    if sampling:
        runs.append(("", "1", "", cuda_home_with_curand(work, cuda_home)))
    for dims, with_sampling, fp8_dims, home in runs:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=f"{site}{os.pathsep}{host_site}",
            FLASHINFER_CUDA_ARCH_LIST=arch,
            FLASHINFER_WORKSPACE_BASE=str(work / "ws"),
            CUDA_HOME=home,
            MAX_JOBS=str(jobs),
            LIBRARY_PATH=f"{libcuda_stub(work)}{os.pathsep}{env.get('LIBRARY_PATH', '')}",
            PATH=f"{host_site / 'bin'}{os.pathsep}{env['PATH']}",
        )
        proc = subprocess.run(
            [sys.executable, str(builder), dims, with_sampling, fp8_dims],
            env=env,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                b = json.loads(line)
                log(f"built {b['name']} in {b['seconds']}s")
                b["deps"] = ninja_deps(Path(b["build_dir"]), env)
                built.append(b)
    return built


def ninja_deps(build_dir: Path, env: dict) -> list[str]:
    out = subprocess.run(
        ["ninja", "-C", str(build_dir), "-t", "deps"], env=env, check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    return sorted({tok for line in out.splitlines() for tok in line.split() if tok.startswith("/")})


def trim(full: Path, out: Path, keep_data: set[Path]) -> None:
    """Copy ``full``/flashinfer into ``out``/flashinfer keeping what import + our kernels need."""
    src_pkg = full / "flashinfer"
    data = src_pkg / "data"
    for path in src_pkg.rglob("*"):
        if path.is_dir() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(full)
        if path.is_relative_to(data):
            sub = path.relative_to(data)
            keep = (
                sub.parts[0] == "aot"
                or path in keep_data
                or (sub.parts[0] == "include")
                or (sub.parts[0] == "csrc" and len(sub.parts) == 2 and path.stat().st_size < CSRC_SMALL)
                or (len(sub.parts) == 1 and path.suffix == ".py")
            )
        else:
            keep = path.suffix == ".py" or path.stat().st_size < SMALL_FILE
        if keep:
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    for info in full.glob("flashinfer_python-*.dist-info"):
        dest = out / info.name
        dest.mkdir(parents=True, exist_ok=True)
        for f in info.iterdir():
            if f.is_dir():
                shutil.copytree(f, dest / f.name)
            elif f.name != "RECORD":
                shutil.copy2(f, dest / f.name)


def tree_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split_file(path: Path, max_bytes: int) -> list[Path]:
    parts = []
    with open(path, "rb") as f:
        i = 0
        while True:
            chunk = f.read(max_bytes)
            if not chunk:
                break
            part = path.with_name(f"{path.name}.part{i:02d}")
            part.write_bytes(chunk)
            parts.append(part)
            i += 1
    path.unlink()
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=FLASHINFER_VERSION, help="flashinfer-python version")
    ap.add_argument("--out", default=str(ROOT / ".device_carry"), help="folder the device call carries")
    ap.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "radixrt-flashinfer-pack"),
        help="downloads and build trees (reused between runs)",
    )
    ap.add_argument("--no-aot", action="store_true", help="skip the ahead-of-time kernel build")
    ap.add_argument("--no-sampling", action="store_true", help="do not AOT-compile the sampling kernels")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument(
        "--fp8-head-dims",
        default="128",
        help="head dims of the fp8-KV modules (gpu_check's fp8kv section); '' for none",
    )
    ap.add_argument("--arch", default="9.0a", help="FLASHINFER_CUDA_ARCH_LIST for the AOT build")
    ap.add_argument("--jobs", type=int, default=1, help="parallel nvcc jobs (this machine's cores are shared)")
    ap.add_argument("--max-part-mib", type=float, default=60.0)
    ap.add_argument("--xz-level", default="9")
    args = ap.parse_args()

    t0 = time.time()
    work = Path(args.work) / args.version
    out = Path(args.out)
    wheels, dev_wheels, host_wheels = work / "wheels", work / "wheels-device", work / "wheels-host"
    for d in (wheels, dev_wheels, host_wheels):
        d.mkdir(parents=True, exist_ok=True)

    # 1. downloads
    if not glob.glob(str(wheels / f"flashinfer_python-{args.version}-*.whl")):
        pip_download(wheels, [f"flashinfer-python=={args.version}"], device=False)
    fi_wheel = one(str(wheels / f"flashinfer_python-{args.version}-*.whl"))
    tvm_req = wheel_requirement(fi_wheel, "apache-tvm-ffi")
    if not glob.glob(str(dev_wheels / "apache_tvm_ffi-*.whl")):
        pip_download(dev_wheels, [tvm_req], device=True)
    dev_tvm = one(str(dev_wheels / "apache_tvm_ffi-*.whl"))
    if not glob.glob(str(dev_wheels / "pyzmq-*.whl")) or not glob.glob(str(dev_wheels / "msgspec-*.whl")):
        pip_download(dev_wheels, DEVICE_RUNTIME_DEPS, device=True)
    dev_runtime = [one(str(dev_wheels / "pyzmq-*.whl")), one(str(dev_wheels / "msgspec-*.whl"))]
    tvm_version = dev_tvm.name.split("-")[1]
    if not glob.glob(str(host_wheels / "apache_tvm_ffi-*.whl")):
        pip_download(host_wheels, [f"apache-tvm-ffi=={tvm_version}", *HOST_HELPERS], device=False)

    # 2. full unpack (the AOT build compiles against it) + host helpers
    full = work / "full-site"
    host_site = work / "host-site"
    if not (full / "flashinfer" / "__init__.py").exists():
        shutil.rmtree(full, ignore_errors=True)
        unpack(fi_wheel, full)
    if not (host_site / "tvm_ffi").exists():
        shutil.rmtree(host_site, ignore_errors=True)
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-compile",
                "--target",
                host_site,
                *sorted(glob.glob(str(host_wheels / "*.whl"))),
            ]
        )

    built: list[dict] = []
    aot_dir = full / "flashinfer" / "data" / "aot"
    if not args.no_aot:
        head_dims = [int(x) for x in args.head_dims.split(",")]
        fp8_head_dims = [int(x) for x in args.fp8_head_dims.split(",") if x]
        built = aot_build(work, full, host_site, head_dims, fp8_head_dims, not args.no_sampling, args.jobs, args.arch)
        shutil.rmtree(aot_dir, ignore_errors=True)
        for b in built:
            dest = aot_dir / b["name"] / f"{b['name']}.so"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(b["so"], dest)
    else:
        shutil.rmtree(aot_dir, ignore_errors=True)
    data_dir = full / "flashinfer" / "data"
    keep_data = {Path(p) for b in built for p in b.get("deps", []) if Path(p).is_relative_to(data_dir)}

    # 3. trimmed tree: flashinfer (trimmed) + the device's tvm_ffi
    stage = work / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    site = stage / "site"
    site.mkdir(parents=True)
    trim(full, site, keep_data)
    unpack(dev_tvm, site)
    for wheel in dev_runtime:  # beside site/: used only where the interpreter lacks them (gpu_check.py)
        unpack(wheel, stage / "runtime")
    log(
        f"trimmed site: {tree_bytes(site) / 2**20:.1f} MiB unpacked "
        f"(full wheel unpacked: {tree_bytes(full) / 2**20:.1f} MiB)"
    )

    # verify on this machine: the trimmed package imports and finds its AOT modules
    # (host tvm_ffi first on the path: the carried one is built for the device's Python)
    env = dict(
        os.environ,
        PYTHONPATH=f"{host_site}{os.pathsep}{site}",
        FLASHINFER_CUDA_ARCH_LIST=args.arch,
        FLASHINFER_WORKSPACE_BASE=str(work / "verify-ws"),
    )
    run([sys.executable, "-c", VERIFY, ",".join(b["name"] for b in built)], env=env, cwd=tempfile.gettempdir())

    # 4. archive, split, manifest
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("flashinfer-*.tar.xz*")) + list(out.glob("manifest.json")):
        old.unlink()
    archive = out / f"flashinfer-{args.version}-sm{args.arch.replace('.', '')}.tar.xz"
    env = dict(os.environ, XZ_OPT=f"-{args.xz_level} -T1")
    run(["tar", "-C", stage, "-cJf", archive, "site", "runtime"], env=env)
    archive_bytes = archive.stat().st_size
    archive_sha = sha256(archive)
    parts = split_file(archive, int(args.max_part_mib * 2**20))
    meta_dir = out / "default_model_meta"
    shutil.rmtree(meta_dir, ignore_errors=True)
    radixrt_home = Path(os.environ.get("RADIXRT_HOME") or Path.home() / ".cache" / "radixrt")
    meta_src = radixrt_home / "models" / "SmolLM2-135M-Instruct"
    if meta_src.is_dir():
        meta_dir.mkdir()
        for name in DEFAULT_MODEL_META:
            if (meta_src / name).is_file():
                shutil.copy2(meta_src / name, meta_dir / name)
    else:
        log(f"{meta_src} not found (run `radixrt download` first): the device check will skip the default model")
    manifest = {
        "flashinfer_version": args.version,
        "tvm_ffi_wheel": dev_tvm.name,
        "runtime_wheels": [w.name for w in dev_runtime],
        "arch": args.arch,
        "aot_modules": [{k: b[k] for k in ("name", "seconds")} for b in built],
        "archive": archive.name,
        "archive_bytes": archive_bytes,
        "archive_sha256": archive_sha,
        "parts": [{"name": p.name, "bytes": p.stat().st_size} for p in parts],
        "unpacked_bytes": tree_bytes(site),
        "wheel_bytes": fi_wheel.stat().st_size,
        "carry_bytes": tree_bytes(out),
        "seconds": round(time.time() - t0, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(
        f"flashinfer-python wheel {fi_wheel.stat().st_size / 2**20:.1f} MiB -> archive "
        f"{archive_bytes / 2**20:.1f} MiB in {len(parts)} part(s); carry folder {out} holds "
        f"{manifest['carry_bytes'] / 2**20:.1f} MiB"
    )
    if manifest["carry_bytes"] > 60 * 2**20:
        log(
            "WARNING: more than 60 MiB to carry: the parts must travel over consecutive calls "
            "(see run_on_gpu.md, 'staging')"
        )


if __name__ == "__main__":
    main()

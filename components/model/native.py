"""The fused C++ kernels of a decode step (csrc/decode_ops.cpp and the files it includes), built with the system compiler.

    python -m components.model.native        # what `make setup` runs: build, or say in one line why not

The extension is compiled for this CPU (`-march=native`, or a smaller CPU kind's instruction sets
where `ATEN_CPU_CAPABILITY` / `ONEDNN_MAX_CPU_ISA` ask for one: `isa_flags`) into
`build/native/<key>/`, where the key digests the source, torch's version, the CPU's model and flags
and the build's flags: a clone moved to another machine builds again, never loads code for another
CPU, and each stand-in has its own build. `load()` returns the module, or None where it is not
built and cannot be (no compiler, a failed build): the model then runs its pure-torch path, which
is also the reference the kernels are tested against (tests/test_native.py). LLM_DECODE_NATIVE=0
turns the kernels off, as `model.native=false` does.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "decode_ops.cpp"  # the translation unit; it includes the other files of csrc/
BUILD_ROOT = Path(__file__).resolve().parents[2] / "build" / "native"
FLAGS = ["-O3", "-fPIC", "-shared", "-std=c++17", "-fopenmp", "-DNDEBUG"]
# The instruction sets the build may use, narrowed by the variables that make torch, oneDNN and MKL
# take the paths of a smaller CPU (docs/precision.md), so that one machine builds and tests the
# kernels of each CPU kind: `ATEN_CPU_CAPABILITY=avx2` (or `ONEDNN_MAX_CPU_ISA=AVX2`) = an AVX2-only
# CPU (x86-64-v3: AVX2 and FMA, no AVX-512), `default` = no AVX; `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`
# = AVX-512 with avx512_bf16 and no AMX, `AVX512_CORE` = AVX-512 without either.
NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]


def isa_flags(env=os.environ) -> list[str]:
    """-march (and -mno-...) for this build: the CPU's own, or less where the environment asks."""
    aten = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    onednn = env.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["-march=native"]
    if aten == "default" or onednn in ("SSE41", "AVX"):
        return ["-march=x86-64-v2", "-mtune=native"]
    if aten == "avx2" or onednn.startswith("AVX2"):
        return ["-march=x86-64-v3", "-mtune=native"]
    if onednn in ("AVX512_CORE", "AVX512_CORE_VNNI"):
        return ["-march=native", "-mno-avx512bf16", "-mno-avx512fp16", *NO_AMX]
    if onednn == "AVX512_CORE_BF16":
        return ["-march=native", "-mno-avx512fp16", *NO_AMX]
    return ["-march=native"]

_module = None
_tried = False
_why = ""


def _cpu() -> str:
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return ""
    first = info.read_text().split("\n\n")[0]
    return "|".join(line for line in first.splitlines() if line.startswith(("model name", "flags")))


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return ""
    r = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    return r.stdout.splitlines()[0] if r.stdout else cxx


def key() -> str:
    """Digest of what the library depends on: the source, torch, the CPU (its model and flags; where
    /proc/cpuinfo is hidden, what platform and torch report) and the compiler."""
    cpu = _cpu() or f"{platform.processor()}|{platform.machine()}|{torch.backends.cpu.get_cpu_capability()}"
    sources = "\n".join(f.read_text() for f in sorted(CSRC.iterdir()) if f.suffix in (".cpp", ".h"))
    parts = [sources, torch.__version__, cpu, " ".join(FLAGS + isa_flags()), sys.version, _compiler()]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def library() -> Path:
    name = f"decode_ops_{key()}"
    return BUILD_ROOT / key() / (name + sysconfig.get_config_var("EXT_SUFFIX"))


def build() -> Path:
    """Compile the extension for this machine (about a minute); raises RuntimeError with the
    compiler's last lines on failure."""
    from torch.utils.cpp_extension import include_paths, library_paths  # it imports setuptools: only a build needs it
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++)")
    out = library()
    out.parent.mkdir(parents=True, exist_ok=True)
    name = out.name.split(".")[0]
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cmd = [cxx, *FLAGS, *isa_flags(), str(SOURCE), f"-I{CSRC}", "-o", str(tmp), f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}",
           *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
           *(f"-Wl,-rpath,{p}" for p in library_paths())]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{Path(cxx).name} failed: {tail}")
    os.replace(tmp, out)  # atomic: a concurrent loader sees the whole library or none
    return out


def _import(path: Path):
    name = path.name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def load(build_if_missing: bool = False):
    """The extension module, or None (then `why()` says why). Built only when asked (make setup)."""
    global _module, _tried, _why
    if _tried and not (build_if_missing and _module is None):
        return _module
    _tried = True
    if os.environ.get("LLM_DECODE_NATIVE", "1") == "0":
        _why = "turned off (LLM_DECODE_NATIVE=0)"
        return None
    path = library()
    try:
        if not path.is_file():
            if not build_if_missing:
                _why = "not built for this machine: run `make setup`"
                return None
            build()
        _module = _import(path)
        _why = ""
    except (RuntimeError, OSError, ImportError) as e:
        _module, _why = None, str(e)
    return _module


def why() -> str:
    return _why


def main() -> int:
    mod = load(build_if_missing=True)
    if mod is None:
        print(f"native kernels not built ({why()}): decoding uses the pure-torch path", file=sys.stderr)
        return 0  # a fallback, not a failure: make setup goes on
    print(f"native kernels built for this CPU ({' '.join(isa_flags())}): {library()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

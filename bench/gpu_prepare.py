"""What a bare GPU machine lacks for bench/gpu_check.py, carried there in parts.

    python bench/gpu_prepare.py download            # here, online: bench/wheels/part-N/
    python bench/gpu_prepare.py download --dry-run  # the list, nothing fetched
    python bench/gpu_prepare.py install             # there: the carried parts into .gpu-site
    python bench/gpu_prepare.py install --dry-run   # what it would install

The GPU machines we are lent (the device tool's notes, as read 2026-11-17) run Python 3.12
with torch 2.11, transformers 5.17, peft, accelerate, pandas, pyarrow, TensorBoard and many
more (THERE below), no network, and take at most 64 MiB of files a call. ``download`` takes
what the train stage needs (NEEDED: DeepSpeed, TRL, datasets, math-verify, jsonschema,
bitsandbytes for a 4-bit base, liger-kernel for its fused kernels) and everything they
require, leaves out what the machine has, adds the tested stack's own versions where the
machine's differ (STACK: transformers, peft, huggingface_hub), and fetches each at this
environment's version (the pins) as a wheel for Linux x86-64 and Python 3.12 (DeepSpeed as
its source archive: it installs with no compiled ops), in parts of at most 60 MiB:
bench/wheels/part-1, ... (ignored by git). Carry the parts (the device tool's ``carry``, one
or more a call within its limit); ``install`` there puts every carried package into
``.gpu-site/`` (ignored; it stays while the machine is warm) with no index and no
dependency resolution; run the check with ``PYTHONPATH=.gpu-site``.
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module, which Python would import
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import importlib.metadata as md
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "bench/wheels"
SITE = ROOT / ".gpu-site"
PART_BYTES = 60 * 2**20
NEEDED = ["trl", "deepspeed", "datasets", "math-verify", "jsonschema", "bitsandbytes",
          "liger-kernel"]  # fmt: skip
STACK = ["transformers", "peft", "huggingface-hub"]  # carried at the pins' versions
PINNED = {"liger-kernel": "0.8.5"}  # the gpu extra's pin (not installed on a CPU machine)
PYTHON = "3.12"  # the GPU machines' python3
# Installed on the GPU machines (the device tool's KINDS.md, 2026-11-17): not carried.
THERE = set(
    [
        "absl-py",
        "accelerate",
        "aiofiles",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "annotated-doc",
        "anyio",
        "attrs",
        "certifi",
        "charset-normalizer",
        "click",
        "cloudpickle",
        "cmake",
        "colorama",
        "contourpy",
        "cycler",
        "cython",
        "einops",
        "filelock",
        "flatbuffers",
        "fonttools",
        "fsspec",
        "grpcio",
        "h11",
        "h5py",
        "hf-xet",
        "httpcore",
        "httpx",
        "huggingface-hub",
        "idna",
        "iniconfig",
        "jinja2",
        "joblib",
        "kiwisolver",
        "markdown",
        "markdown-it-py",
        "markupsafe",
        "matplotlib",
        "mdurl",
        "mpmath",
        "msgpack",
        "multidict",
        "networkx",
        "ninja",
        "numpy",
        "packaging",
        "pandas",
        "peft",
        "pillow",
        "pip",
        "pluggy",
        "propcache",
        "protobuf",
        "psutil",
        "pyarrow",
        "py-cpuinfo",
        "pygments",
        "pyparsing",
        "pytest",
        "python-dateutil",
        "pyyaml",
        "regex",
        "requests",
        "rich",
        "safetensors",
        "scipy",
        "sentencepiece",
        "setuptools",
        "shellingham",
        "six",
        "sympy",
        "tensorboard",
        "tensorboard-data-server",
        "tokenizers",
        "torch",
        "tqdm",
        "transformers",
        "triton",
        "typer",
        "typing-extensions",
        "urllib3",
        "werkzeug",
        "wheel",
        "wrapt",
        "xxhash",
        "yarl",
        "zipp",
    ]
)
SOURCE_ONLY = {"deepspeed"}  # published as a source archive only
# bitsandbytes' wheel holds a library per CUDA, ROCm and XPU release (129 MB unpacked, 43 MB
# packed, most of a call's 64 MiB): keep those of the GPU machines' CUDA (torch 2.11+cu130)
# and the CPU one, so that everything travels in one call.
CUDA_KEPT = ("cuda130", "cuda132")


def slim(wheel: Path) -> None:
    """Drop from bitsandbytes' ``wheel`` the native libraries of other CUDA, ROCm and XPU
    releases than CUDA_KEPT (and their RECORD lines)."""
    import zipfile

    def dropped(name: str) -> bool:
        lib = re.fullmatch(r"bitsandbytes/libbitsandbytes_(\w+)\.(so|dll|dylib)", name)
        return bool(lib) and lib[1] != "cpu" and lib[1] not in CUDA_KEPT

    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if dropped(item.filename):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if not dropped(ln.split(",")[0])).encode()
            dst.writestr(item, data)
    slimmed.replace(wheel)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requires(name: str) -> list[str]:
    """The names a distribution requires (no extras)."""
    try:
        reqs = md.distribution(name).requires or []
    except md.PackageNotFoundError:
        return []
    return [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r]


def closure(roots: list[str]) -> dict[str, str | None]:
    """Each of ``roots`` and what it requires, transitively, with the version installed here
    (None: not installed here)."""
    found: dict[str, str | None] = {}
    todo = list(roots)
    while todo:
        name = norm(todo.pop())
        if name in found:
            continue
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
        todo += requires(name)
    return found


def wanted() -> dict[str, str]:
    """What to carry: NEEDED's closure but what the machine has, and STACK, at this
    environment's versions."""
    found = {n: v or PINNED.get(n) for n, v in closure(NEEDED).items()}
    carry = {n: v for n, v in found.items() if n not in THERE and v is not None
             and not n.startswith("nvidia-")}  # fmt: skip
    return {**carry, **{norm(n): md.version(n) for n in STACK}}


def parts(files: list[Path]) -> list[list[Path]]:
    """``files`` in parts of at most PART_BYTES, the largest first (first fit)."""
    bins: list[list[Path]] = []
    sizes: list[int] = []
    for f in sorted(files, key=lambda p: p.stat().st_size, reverse=True):
        size = f.stat().st_size
        for i, used in enumerate(sizes):
            if used + size <= PART_BYTES:
                bins[i].append(f)
                sizes[i] += size
                break
        else:
            bins.append([f])
            sizes.append(size)
    return bins


def download(dry_run: bool) -> int:
    pins = wanted()
    print(
        f"{len(pins)} packages to carry: " + " ".join(f"{n}=={v}" for n, v in sorted(pins.items()))
    )
    if dry_run:
        return 0
    fetched = WHEELS / "fetched"
    fetched.mkdir(parents=True, exist_ok=True)
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "any"]  # fmt: skip
    binary = [f"{n}=={v}" for n, v in pins.items() if n not in SOURCE_ONLY]
    source = [f"{n}=={v}" for n, v in pins.items() if n in SOURCE_ONLY]
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(fetched)]
    subprocess.run([*pip, "--only-binary=:all:", "--python-version", PYTHON, "--implementation",
                    "cp", *[a for p in platforms for a in ("--platform", p)], *binary],
                   check=True)  # fmt: skip
    if source:
        subprocess.run([*pip, "--no-binary=:all:", *source], check=True)
    for wheel in fetched.glob("bitsandbytes-*.whl"):
        slim(wheel)
    for i, part in enumerate(parts(sorted(fetched.iterdir())), 1):
        folder = WHEELS / f"part-{i}"
        folder.mkdir(exist_ok=True)
        for f in part:
            f.replace(folder / f.name)
        mib = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
        print(f"bench/wheels/part-{i}: {len(part)} files, {mib:.1f} MiB")
    fetched.rmdir()
    return 0


def dist_name(file: Path) -> str:
    """A wheel's or source archive's distribution name."""
    stem = file.name.removesuffix(".tar.gz").removesuffix(".whl")
    return norm(re.split(r"-\d", stem, maxsplit=1)[0])


def install(dry_run: bool) -> int:
    files = sorted(WHEELS.glob("part-*/*"))
    print(f"carried: {len(files)} packages in {len({f.parent for f in files})} part(s): "
          f"{', '.join(dist_name(f) for f in files) or 'nothing'}")  # fmt: skip
    if dry_run or not files:
        return 0
    SITE.mkdir(exist_ok=True)
    env = {**os.environ, "DS_BUILD_OPS": "0", "PIP_NO_INDEX": "1"}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "--no-compile", "--upgrade", "--target", str(SITE), *map(str, files)]  # fmt: skip
    return subprocess.run(cmd, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("what", choices=["download", "install"])
    parser.add_argument("--dry-run", action="store_true", help="say what, change nothing")
    args = parser.parse_args()
    return download(args.dry_run) if args.what == "download" else install(args.dry_run)


if __name__ == "__main__":
    sys.exit(main())

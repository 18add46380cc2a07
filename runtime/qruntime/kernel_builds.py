"""The Triton kernels an artifact's engine launches on one GPU model, as choices: kernel_builds/<device>.json.

    {"device": "NVIDIA H200", "capability": [9, 0], "triton": "3.6.0",
     "kernels": [{"kernel": "qruntime.kernels.dynamic_quant:_dynamic_quant_kernel",
                  "signature": {"x_ptr": "*bf16", ..., "BLOCK": "constexpr"},
                  "constants": [[[5], 1024], [[7], true], ...],
                  "attrs": [[[0], [["tt.divisibility", 16]]], ...],
                  "options": {"num_warps": 4, "num_stages": 3, "launch_pdl": true}}, ...]}

`qcompile tune` writes it (qcompile.tune.builds: a fresh process loads the tuned artifact and
records every kernel Triton compiles for it, `recorded_builds`); a load on that GPU model builds
them all in parallel while it reads the weights (qruntime.kernel_prebuild), so the first steps find
them built instead of compiling each one as they first launch it. The records are listed longest
compile first (as tune measured them), the order that build hands them to its workers.

A record is a choice, never code. Its kernel names a `@triton.jit` function of this runtime
(`qruntime.kernels.<module>:<function>`, found by import, any other name refused); the rest is the
specialization Triton compiles that function's own source with: argument types, constexpr values
(numbers, booleans, short names), the divisibility hints, and the launch options in OPTIONS (each
checked; any other option a record holds, such as `extern_libs` or `ir_override`, is never read,
Triton's default stands). So a downloaded artifact can choose which of our kernels are built, at
which block sizes, but cannot make us run GPU code it ships: there is nothing to trust and no
`--trust-kernels` flag. What is built goes into Triton's own cache, whose key is Triton's: the
function's source and the sources of the functions it calls, the specialization, the options, the
target GPU architecture, Triton's version and the environment variables that change compilation.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable, Container, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from qruntime import bounded_json
from qruntime.artifact import ArtifactFormatError, optional_artifact_path
from qruntime.kernel_configs import device_file
from qruntime.shown import shown

BUILDS_DIR = "kernel_builds"
KERNEL_PACKAGE = "qruntime.kernels."  # the only modules a record's kernel may come from
MAX_KERNELS = 4096  # records a file may hold (an 8B engine launches ~100 kernels, a MoE ~150)
MAX_BYTES = 32 << 20
_KERNEL = re.compile(r"qruntime\.kernels\.[a-z0-9_]{1,64}:[A-Za-z_][A-Za-z0-9_]{0,127}")
_ARG = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_TYPE = re.compile(r"constexpr|\*?k?[a-z][a-z0-9]{0,15}")  # i32, fp32, *bf16, *fp8e4nv, u1, *ku8 ...
_NAME = re.compile(r"[A-Za-z0-9_.]{0,64}")  # a string constant: a dtype's name ("fp8e4nv") or a mode
ATTRS = MappingProxyType({"tt.divisibility": (1, 1 << 12)})  # the hints a record may give, and their range


def _pow2(least: int, most: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and least <= v <= most and v & (v - 1) == 0


def _count(least: int, most: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and least <= v <= most


def _flag(v: Any) -> bool:
    return type(v) is bool


# the launch options a record carries to Triton, each with its check; Triton defaults the others
OPTIONS: Mapping[str, Callable[[Any], bool]] = MappingProxyType(
    {
        "num_warps": _pow2(1, 32),
        "num_ctas": _pow2(1, 16),
        "num_stages": _count(0, 16),
        "maxnreg": lambda v: v is None or _count(16, 256)(v),
        "enable_fp_fusion": _flag,
        "launch_cooperative_grid": _flag,
        "launch_pdl": _flag,
    }
)


def _path(value: Any, where: str) -> tuple[int, ...]:
    """An argument's path in a record (`[5]`: the sixth parameter)."""
    if not isinstance(value, list) or not 1 <= len(value) <= 4 or not all(_count(0, 255)(i) for i in value):
        raise ValueError(f"{where}: an argument path is a list of 1 to 4 indices in 0..255 (got {shown(value)})")
    return tuple(value)


def _pairs(data: dict, key: str, where: str) -> list[tuple[str, tuple[int, ...], Any]]:
    """A record's list of [argument path, value] pairs under `key` (constants, attrs), each with
    where it stands, its path checked."""
    items = data.get(key, [])
    if not isinstance(items, list) or len(items) > 256:
        raise ValueError(f"{where}.{key}: a list of up to 256 [path, value] pairs")
    out, seen = [], set()
    for i, pair in enumerate(items):
        at = f"{where}.{key}[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{at}: a [path, value] pair")
        path = _path(pair[0], at)
        if path in seen:
            raise ValueError(f"{at}: argument path {list(path)} given twice")
        seen.add(path)
        out.append((at, path, pair[1]))
    return out


def _constant(value: Any, where: str) -> Any:
    """A constexpr value a record may hold: None, a boolean, an integer, a finite float, a short
    name, or {"constexpr": one of those} (Triton's tl.constexpr, as it serializes it)."""
    if isinstance(value, dict) and set(value) == {"constexpr"}:
        return {"constexpr": _constant(value["constexpr"], where)}
    ok = (
        value is None
        or type(value) is bool
        or (type(value) is int and abs(value) < 1 << 63)
        or (type(value) is float and math.isfinite(value))
        or (isinstance(value, str) and _NAME.fullmatch(value) is not None)
    )
    if not ok:
        raise ValueError(f"{where}: a constant is a number, a boolean, null or a short name (got {shown(value)})")
    return value


@dataclass(frozen=True)
class KernelBuild:
    """One kernel specialization, checked (module docstring). Mappings are kept as sorted tuples."""

    kernel: str  # "qruntime.kernels.<module>:<function>"
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type), in parameter order
    constants: tuple[tuple[tuple[int, ...], Any], ...]  # (argument path, value)
    attrs: tuple[tuple[tuple[int, ...], tuple[tuple[str, int], ...]], ...]  # (argument path, hints)
    options: tuple[tuple[str, Any], ...]  # (option, value), only OPTIONS' keys

    @classmethod
    def from_dict(cls, data: Any, where: str) -> KernelBuild:
        """The record of parsed JSON `data`; a ValueError naming `where` and the field at fault."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a kernel record is an object")
        kernel = data.get("kernel")
        if not isinstance(kernel, str) or not _KERNEL.fullmatch(kernel):
            raise ValueError(
                f"{where}.kernel: not a kernel of this runtime ({KERNEL_PACKAGE}<module>:<function>): {shown(kernel)}"
            )
        signature = data.get("signature")
        if not isinstance(signature, dict) or not 0 < len(signature) <= 256:
            raise ValueError(f"{where}.signature: an object of 1 to 256 parameters and their types")
        for arg, kind in signature.items():
            if not _ARG.fullmatch(arg) or not isinstance(kind, str) or not _TYPE.fullmatch(kind):
                raise ValueError(f"{where}.signature[{shown(arg)}]: not a parameter and a Triton type ({shown(kind)})")
        consts = [(path, _constant(value, at)) for at, path, value in _pairs(data, "constants", where)]
        hints = []
        for at, path, given in _pairs(data, "attrs", where):
            if not isinstance(given, list) or len(given) > 4:
                raise ValueError(f"{at}: hints are a list of up to 4 [hint, value] pairs")
            for hint in given:
                ok = isinstance(hint, list) and len(hint) == 2 and isinstance(hint[0], str)
                bounds = ATTRS.get(hint[0]) if ok else None
                if bounds is None or not _count(*bounds)(hint[1]):
                    raise ValueError(f"{at}: a hint is one of {', '.join(ATTRS)} with a count (got {shown(hint)})")
            hints.append((path, tuple((hint[0], hint[1]) for hint in given)))
        options = data.get("options", {})
        if not isinstance(options, dict):
            raise ValueError(f"{where}.options: an object of launch options")
        kept = []
        for key, check in OPTIONS.items():
            if key in options:
                if not check(options[key]):
                    raise ValueError(f"{where}.options.{key}: {shown(options[key])} is out of range")
                kept.append((key, options[key]))
        by_path = lambda pair: pair[0]  # noqa: E731 - values of several types do not compare
        return cls(
            kernel,
            tuple(signature.items()),
            tuple(sorted(consts, key=by_path)),
            tuple(sorted(hints, key=by_path)),
            tuple(kept),
        )

    @classmethod
    def from_specialization(cls, module: str, name: str, specialization: str) -> KernelBuild:
        """The record of a compile Triton reports to its jit hooks (`specialization_data`, the JSON
        that triton.runtime.jit.serialize_specialization_data writes)."""
        data = json.loads(specialization)
        return cls.from_dict(
            {
                "kernel": f"{module}:{name}",
                "signature": data["signature"],
                "constants": [[list(k), v] for k, v in zip(data["constant_keys"], data["constant_vals"], strict=True)],
                "attrs": [[list(k), v] for k, v in zip(data["attrs_keys"], data["attrs_vals"], strict=True)],
                "options": data["options"],
            },
            f"{module}:{name}",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "signature": dict(self.signature),
            "constants": [[list(path), value] for path, value in self.constants],
            "attrs": [[list(path), [list(h) for h in hints]] for path, hints in self.attrs],
            "options": dict(self.options),
        }

    def describe(self) -> str:
        """The kernel and its choices, short: how errors and reports name it."""
        names = [arg for arg, _ in self.signature]
        consts = [f"{names[p[0]] if p[0] < len(names) else p}={v}" for p, v in self.constants if len(p) == 1]
        opts = [f"{k}={v}" for k, v in self.options]
        return f"{self.kernel.split(':', 1)[1]}[{', '.join(opts + consts)}]"

    def resolve(self) -> Any:
        """The runtime's JITFunction this record names (importing its module); a ValueError when the
        name is not one, or when the record's parameters are not the function's."""
        import importlib

        import triton

        module_name, attr = self.kernel.split(":", 1)
        if not module_name.startswith(KERNEL_PACKAGE):
            raise ValueError(f"{self.kernel}: not a kernel of this runtime")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{self.kernel}: no such kernel module in this runtime ({exc})") from None
        fn = getattr(module, attr, None)
        if not isinstance(fn, triton.runtime.jit.JITFunction) or fn.module != module_name:
            raise ValueError(f"{self.kernel}: not a @triton.jit kernel defined in {module_name}")
        params = [p.name for p in fn.params]
        if [arg for arg, _ in self.signature] != params:
            raise ValueError(f"{self.kernel}: the record's parameters are not the kernel's ({', '.join(params)})")
        for path, _ in (*self.constants, *self.attrs):
            if path[0] >= len(params):
                raise ValueError(
                    f"{self.kernel}: argument path {list(path)} past the kernel's {len(params)} parameters"
                )
        return fn

    def source(self, fn: Any) -> Any:
        """Triton's ASTSource of `fn` at this specialization, its values decoded as Triton's own
        JITFunction.preload decodes them; a ValueError for a string constant that names no dtype
        (Triton's cache key holds a constant's text, so any other string could stand for something
        else, a torch dtype's name for the dtype)."""
        import triton.language as tl
        from triton.compiler import ASTSource

        def decode(value: Any) -> Any:
            if isinstance(value, dict):
                return tl.constexpr(decode(value["constexpr"]))
            if isinstance(value, str):  # Triton keys a constant by its text: only a dtype's name is one
                if not tl.dtype.is_dtype(value):
                    raise ValueError(f"{self.kernel}: constant {value!r} is not a Triton dtype's name")
                return tl.dtype(value)
            return value

        constants = {path: decode(value) for path, value in self.constants}
        attrs = {path: [list(hint) for hint in hints] for path, hints in self.attrs}
        return ASTSource(fn, dict(self.signature), constants, attrs)


@dataclass(frozen=True)
class BuildList:
    device: str
    capability: tuple[int, int]
    triton: str
    kernels: tuple[KernelBuild, ...]

    @classmethod
    def from_dict(cls, data: Any, where: str) -> BuildList:
        if not isinstance(data, dict) or not isinstance(data.get("device"), str):
            raise ValueError(f"{where}: not a kernel build list (an object with a string `device`)")
        capability = data.get("capability")
        if not isinstance(capability, list) or len(capability) != 2 or not all(_count(0, 99)(c) for c in capability):
            raise ValueError(f"{where}.capability: [major, minor] of the GPU it was recorded on")
        if not isinstance(data.get("triton"), str) or not _NAME.fullmatch(data["triton"].replace("+", ".")):
            raise ValueError(f"{where}.triton: the Triton version it was recorded with")
        kernels = data.get("kernels")
        if not isinstance(kernels, list) or len(kernels) > MAX_KERNELS:
            raise ValueError(f"{where}.kernels: a list of up to {MAX_KERNELS} kernel records")
        records = tuple(KernelBuild.from_dict(k, f"{where}.kernels[{i}]") for i, k in enumerate(kernels))
        return cls(data["device"], (capability[0], capability[1]), data["triton"], records)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "capability": list(self.capability),
            "triton": self.triton,
            "kernels": [k.to_dict() for k in self.kernels],
        }


def builds_file(device_name: str) -> str:
    """The artifact-relative path of GPU model `device_name`'s build list."""
    return f"{BUILDS_DIR}/{device_file(device_name)}"


def read_build_list(
    root: str | Path, device_name: str, capability: tuple[int, int], triton_version: str, listed: Container[str]
) -> BuildList | None:
    """The artifact's build list for this GPU, or None: when it has none (quietly), or when the list
    cannot serve this machine, with a warning saying why: unreadable or malformed (naming the file
    and the field), recorded for another GPU model or architecture, or with another Triton (whose
    specializations differ). None only costs speed: each kernel is then compiled when first launched."""
    rel = builds_file(device_name)
    try:
        path = optional_artifact_path(root, rel, listed=listed)
        if path is None:
            return None
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"{path}: {path.stat().st_size} bytes, more than a build list holds ({MAX_BYTES})")
        builds = BuildList.from_dict(bounded_json.loads(path.read_bytes(), what=str(path)), str(path))
    except (OSError, ValueError, ArtifactFormatError) as exc:
        warnings.warn(f"kernel build list ignored, kernels build as they launch: {exc}", stacklevel=2)
        return None
    if (builds.device, builds.capability, builds.triton) != (device_name, tuple(capability), triton_version):
        warnings.warn(
            f"{path}: recorded on {builds.device} (sm {builds.capability[0]}{builds.capability[1]}) with Triton "
            f"{builds.triton}, not on this {device_name} (sm {capability[0]}{capability[1]}) with Triton "
            f"{triton_version}: ignored, kernels build as they launch",
            stacklevel=2,
        )
        return None
    return builds


@dataclass(frozen=True)
class Recording:
    kernels: list[KernelBuild]  # in the order first compiled, each specialization once
    skipped: list[str]  # compiles no record can hold (the kernel and why)


@contextmanager
def recorded_builds() -> Iterator[Recording]:
    """Within the block, every compile of one of the runtime's kernels that Triton's JIT does in this
    process (a build or a hit in Triton's cache) is recorded. Chains to a jit_post_compile_hook set
    before; restores it after."""
    import triton

    knobs = triton.knobs.runtime
    before = knobs.jit_post_compile_hook
    seen: set[KernelBuild] = set()
    recording = Recording([], [])

    def hook(**kwargs: Any) -> Any:
        fn = kwargs["fn"]
        module = fn.module if isinstance(fn.module, str) else fn.module.__name__
        if module.startswith(KERNEL_PACKAGE):
            try:
                record = KernelBuild.from_specialization(module, fn.name, kwargs["compile"]["specialization_data"])
            except (KeyError, TypeError, ValueError) as exc:
                recording.skipped.append(f"{module}:{fn.name}: {exc}")
            else:
                if record not in seen:
                    seen.add(record)
                    recording.kernels.append(record)
        return before(**kwargs) if before is not None else None

    knobs.jit_post_compile_hook = hook
    try:
        yield recording
    finally:
        knobs.jit_post_compile_hook = before

"""What a run recorded about the machine it computed on (campaign.json's `environment`, built by
harness/runtime/environment.py's `record` from the ranks' reports): read back, summarized for
the report, and compared between runs, which tells `sdc-regress` whether two runs' numbers may
differ; and whether two runs trained the same workload, without which their trial ids name other
trials."""

from __future__ import annotations

from pathlib import Path

from harness.results.folder import RunFolder

# Fields whose difference changes the numbers a run computes; the others say where and from
# which code it ran (a code change is the commit's to say, and may or may not change them).
NUMERIC = ("torch", "machine", "cpu_capability", "math_library", "math_settings", "threads",
           "device", "backend", "cpu_numerics")  # fmt: skip
# Records from before `topology.cpu_numerics` lack the field; their ranks computed natively.
BEFORE_NUMERICS = {"cpu_numerics": "native"}


def recorded(folder: Path) -> dict[str, str] | None:
    """The environment a run folder's campaign.json records (None when it records none)."""
    env = (RunFolder(folder).campaign_record() or {}).get("environment")
    return {**BEFORE_NUMERICS, **env} if env else None


def code_of_runs(folders: list[Path]) -> dict[str, str] | None:
    """The digests of the sources the given run folders' campaign.json record, where they all
    record the same ones (None when one records none, or they differ)."""
    return _shared([(RunFolder(f).campaign_record() or {}).get("code") for f in folders])


def code_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The packages whose sources' digests two records of `code` differ in."""
    return sorted(k for k in {*before, *after} if before.get(k) != after.get(k))


def workload_differences(base: Path, cur: Path) -> str:
    """The workload keys two run folders' campaign.json set otherwise, as `workload.key a -> b`
    ('' where they agree, or either folder records none: a sweep's jobs record their own)."""
    held = [(RunFolder(f).campaign_record() or {}).get("workload") for f in (base, cur)]
    if not all(held):
        return ""
    before, after = held
    keys = sorted(k for k in {*before, *after} if before.get(k) != after.get(k))
    return "; ".join(f"workload.{k} {before.get(k)} -> {after.get(k)}" for k in keys)


def of_runs(folders: list[Path]) -> dict[str, str] | None:
    """The one environment the given run folders share; None when one is unknown or they differ."""
    return _shared([recorded(f) for f in folders])


def _shared(found: list[dict[str, str] | None]) -> dict[str, str] | None:
    if not found or any(e is None for e in found) or any(e != found[0] for e in found):
        return None
    return found[0]


def commit_label(env: dict[str, str]) -> str:
    """The commit an environment records, short, with `+dirty` where its tree had changes."""
    return f"{env['commit'][:12]}{'+dirty' if env['commit'].endswith('+dirty') else ''}"


def summary(env: dict[str, str] | None) -> str:
    """The environment in one line (the report's header)."""
    if not env:
        return "unknown (not recorded)"
    return (
        f"commit {commit_label(env)}, "
        f"torch {env['torch']}, Python {env['python']}, {env['cpu']} ({env['machine']}), "
        f"kernels {env['cpu_capability']} (cpu_kernels={env['cpu_kernels']}), "
        f"{env['math_library']} [{env['math_settings']}], {env['threads']} thread(s)/rank, "
        f"{env['device']}/{env['backend']}"
    )


def numerics(env: dict[str, str] | None) -> str:
    """How the run's 16-bit matrix products were computed, one line (the report's header)."""
    if not env:
        return "unknown (not recorded)"
    if env["cpu_numerics"] == "emulated":
        return (
            "16-bit matrix products emulated (topology.cpu_numerics=emulated): 16-bit operands, "
            "float32 accumulation, output rounded to 16 bits, through float32 kernels, the CPU's "
            "model of a GPU's bf16/fp16 GEMM; float32 products unchanged"
        )
    return f"16-bit matrix products native on {env['device']} (topology.cpu_numerics=native)"


def differences(before: dict[str, str] | None, after: dict[str, str] | None) -> list[str]:
    """The fields two environments differ in; every numeric field when either is unknown."""
    if not before or not after:
        return list(NUMERIC)
    fields = [*NUMERIC, *(k for k in sorted({*before, *after}) if k not in NUMERIC)]
    return [f for f in fields if before.get(f) != after.get(f)]


def same_numbers(before: dict[str, str] | None, after: dict[str, str] | None) -> bool:
    """Whether two runs computed under the same numeric environment (both known)."""
    return not any(f in NUMERIC for f in differences(before, after))

"""GPU health watchdog: samples this process's GPU every N seconds during training.

Each sample reads, through NVML (the ``nvidia-ml-py`` package, present on GPU machines):
uncorrectable ECC errors, temperature against the GPU's slowdown and shutdown thresholds,
clock-throttle reasons, and device memory. Every sample gives one health line in the log
and the last one is folded into the training metrics. A fatal condition

- uncorrectable ECC errors that appeared during the job,
- temperature within ``temperature_margin_c`` of the shutdown threshold,
- hardware slowdown throttling in ``throttle_samples`` samples in a row,

sets :attr:`Watchdog.fatal`; the training loop then saves a checkpoint on every rank and
stops, and the launcher ends with one line naming the host and the GPU. An optional
webhook (its URL in an environment variable, never in the config: such URLs are secrets)
receives the event as JSON. Warnings (near the slowdown temperature, thermal or power
throttling, memory nearly full) are logged and recorded, nothing more.

Without NVML or without a GPU the watchdog is off, with one log line saying so. For tests
and drills, ``SNAKETUNE_GPU_HEALTH_FILE`` names a JSON file read as the samples instead
(``{"0": {"temperature_c": 91, "ecc_uncorrectable": 2, ...}}``, or a list of such
samples per GPU, taken in turn).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from snaketune.core.io import host_name
from snaketune.core.job import WorkerEnv

log = logging.getLogger(__name__)

FILE_ENV = "SNAKETUNE_GPU_HEALTH_FILE"
OK, WARNING, FATAL = 0, 1, 2
STATUS = {OK: "ok", WARNING: "warning", FATAL: "fatal"}
LEVEL = {name: level for level, name in STATUS.items()}


@dataclass
class GpuSample:
    """One reading of one GPU (None: the GPU does not report it)."""

    index: int
    name: str = "GPU"
    temperature_c: float | None = None
    slowdown_c: float | None = None
    shutdown_c: float | None = None
    ecc_uncorrectable: int | None = None
    throttle: list[str] = field(default_factory=list)
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None


class Reader(Protocol):
    def sample(self, index: int) -> GpuSample: ...


@dataclass(frozen=True)
class Limits:
    """When a sample is a warning or fatal (the run's `health` settings)."""

    temperature_margin_c: float = 5.0
    throttle_samples: int = 3
    memory_warn_fraction: float = 0.98


class NvmlReader:
    """Samples through NVML (pynvml from nvidia-ml-py)."""

    def __init__(self):
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()

    def _try(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self.nv.NVMLError:  # not supported on this GPU (e.g. ECC on consumer cards)
            return None

    def sample(self, index: int) -> GpuSample:
        nv = self.nv
        h = nv.nvmlDeviceGetHandleByIndex(index)
        name = nv.nvmlDeviceGetName(h)
        reasons = self._try(lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)) or 0
        bits = {
            "hw_slowdown": nv.nvmlClocksThrottleReasonHwSlowdown,
            "hw_thermal_slowdown": getattr(nv, "nvmlClocksThrottleReasonHwThermalSlowdown", 0),
            "hw_power_brake": getattr(nv, "nvmlClocksThrottleReasonHwPowerBrakeSlowdown", 0),
            "sw_thermal_slowdown": getattr(nv, "nvmlClocksThrottleReasonSwThermalSlowdown", 0),
        }
        mem = self._try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        return GpuSample(
            index=index,
            name=name.decode() if isinstance(name, bytes) else str(name),
            temperature_c=self._try(
                lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
            ),
            slowdown_c=self._try(
                lambda: nv.nvmlDeviceGetTemperatureThreshold(
                    h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
                )
            ),
            shutdown_c=self._try(
                lambda: nv.nvmlDeviceGetTemperatureThreshold(
                    h, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
                )
            ),
            ecc_uncorrectable=self._try(
                lambda: nv.nvmlDeviceGetTotalEccErrors(
                    h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                )
            ),
            throttle=[k for k, bit in bits.items() if bit and reasons & bit],
            memory_used_mib=mem.used / 2**20 if mem else None,
            memory_total_mib=mem.total / 2**20 if mem else None,
        )


class FileReader:
    """Samples from a JSON file (tests and drills), read again at every sample: per GPU
    index, one sample's fields, or a list of them taken in turn (the last one repeats)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.taken: dict[int, int] = {}

    def sample(self, index: int) -> GpuSample:
        entry = json.loads(self.path.read_text()).get(str(index), {})
        if isinstance(entry, list):
            n = self.taken.get(index, 0)
            self.taken[index] = n + 1
            entry = entry[min(n, len(entry) - 1)]
        return GpuSample(**{**entry, "index": index})


def open_reader(cuda_available: bool) -> tuple[Reader | None, str]:
    """The reader for this machine, or None with the reason the watchdog is off."""
    if os.environ.get(FILE_ENV):
        return FileReader(os.environ[FILE_ENV]), f"samples from {os.environ[FILE_ENV]}"
    if not cuda_available:
        return None, "no GPU on this machine"
    try:
        return NvmlReader(), "NVML"
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    except Exception as exc:  # NVMLError_LibraryNotFound, driver mismatch, ...
        return None, f"NVML unavailable ({exc})"


def assess(
    s: GpuSample, limits: Limits, ecc_baseline: int, hw_slow_run: int
) -> tuple[int, list[str]]:
    """Status and problems of one sample (``hw_slow_run``: consecutive hw-slowdown samples,
    this one included)."""
    level, problems = OK, []

    def flag(lvl: int, text: str) -> None:
        nonlocal level
        level = max(level, lvl)
        problems.append(text)

    if s.ecc_uncorrectable is not None and s.ecc_uncorrectable > ecc_baseline:
        flag(FATAL, f"{s.ecc_uncorrectable - ecc_baseline} uncorrectable ECC error(s)")
    t = s.temperature_c
    if t is not None and s.shutdown_c and t >= s.shutdown_c - limits.temperature_margin_c:
        flag(FATAL, f"temperature {t:g} C, shutdown at {s.shutdown_c:g} C")
    elif t is not None and s.slowdown_c and t >= s.slowdown_c - limits.temperature_margin_c:
        flag(WARNING, f"temperature {t:g} C, slowdown at {s.slowdown_c:g} C")
    if "hw_slowdown" in s.throttle and hw_slow_run >= limits.throttle_samples:
        flag(FATAL, f"hardware slowdown throttling in {hw_slow_run} samples in a row")
    elif s.throttle:
        flag(WARNING, f"clocks throttled ({', '.join(s.throttle)})")
    used, total = s.memory_used_mib, s.memory_total_mib
    if used is not None and total and used >= limits.memory_warn_fraction * total:
        flag(WARNING, f"memory {used:.0f}/{total:.0f} MiB")
    return level, problems


def post_webhook(url: str, event: dict[str, Any], timeout: float = 5.0) -> bool:
    """POST ``event`` as JSON; False (logged, URL not shown) when it fails."""
    request = urllib.request.Request(
        url,
        data=json.dumps(event).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return 200 <= response.status < 300
    except OSError as exc:
        log.warning("GPU health webhook failed (%s)", type(exc).__name__)
        return False


class Watchdog:
    """Samples GPU ``index`` every ``interval`` seconds in a daemon thread."""

    def __init__(
        self,
        reader: Reader,
        index: int,
        interval: float,
        limits: Limits,
        records: Path | None = None,
        webhook_url: str | None = None,
        context: dict[str, Any] | None = None,
    ):
        self.reader, self.index, self.interval, self.limits = reader, index, interval, limits
        self.records, self.webhook_url = records, webhook_url
        self.host = host_name()
        self.context = context or {}
        self.fatal: str | None = None
        self.last: dict[str, Any] | None = None
        self._ecc_baseline: int | None = None
        self._hw_slow_run = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> dict[str, Any]:
        """Take one sample: log and record it, and handle a fatal condition."""
        s = self.reader.sample(self.index)
        if self._ecc_baseline is None:  # errors from before the job: a warning, not fatal
            self._ecc_baseline = s.ecc_uncorrectable or 0
            if self._ecc_baseline:
                log.warning(
                    "GPU %d reports %d uncorrectable ECC errors from before this job",
                    self.index,
                    self._ecc_baseline,
                )
        self._hw_slow_run = self._hw_slow_run + 1 if "hw_slowdown" in s.throttle else 0
        level, problems = assess(s, self.limits, self._ecc_baseline, self._hw_slow_run)
        record = {
            "event": "gpu_health",
            "time": round(time.time(), 3),
            "host": self.host,
            **{k: v for k, v in dataclasses.asdict(s).items() if v is not None},
            "status": STATUS[level],
            "problems": problems,
            **self.context,
        }
        self.last = record
        line = (
            f"GPU health {self.host} GPU {s.index}: {STATUS[level]}"
            f" | {s.temperature_c if s.temperature_c is not None else '?'} C"
            f" | memory {s.memory_used_mib or 0:.0f}/{s.memory_total_mib or 0:.0f} MiB"
            f" | ECC {s.ecc_uncorrectable if s.ecc_uncorrectable is not None else '?'}"
            f" | throttle {','.join(s.throttle) or 'none'}"
            + (f" | {'; '.join(problems)}" if problems else "")
        )
        if level == OK:
            log.info(line)
        else:
            log.warning(line)
        if self.records is not None:
            self.records.parent.mkdir(parents=True, exist_ok=True)
            with open(self.records, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        if level == FATAL and self.fatal is None:
            self.fatal = f"{self.host} GPU {s.index} ({s.name}): {'; '.join(problems)}"
            log.error("GPU health: fatal: %s; stopping after a checkpoint", self.fatal)
            if self.webhook_url:
                post_webhook(
                    self.webhook_url, {**record, "event": "gpu_fatal", "message": self.fatal}
                )
        return record

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception as exc:  # a flaky read must not take training down
                log.warning("GPU health: sample failed (%s: %s)", type(exc).__name__, exc)
            self._stop.wait(self.interval)

    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._loop, name="gpu-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)


# ----------------------------------------------------------------------------- in a worker


def start_watchdog(
    cfg: dict[str, Any], env: WorkerEnv, ckpt_dir: Path, run: str
) -> Watchdog | None:
    """This process's GPU watchdog (snaketune.train.health), or None (off, said once in the log)."""
    if not cfg["enabled"]:
        return None
    import torch

    reader, how = open_reader(torch.cuda.is_available())
    if reader is None:
        if env.rank == 0:
            log.info("GPU health watchdog: off (%s)", how)
        return None
    index = env.local_rank
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    mine = visible[env.local_rank].strip() if len(visible) > env.local_rank else ""
    if torch.cuda.is_available() and mine.isdigit():  # NVML numbers GPUs physically
        index = int(mine)
    limits = Limits(
        cfg["temperature_margin_c"], cfg["throttle_samples"], cfg["memory_warn_fraction"]
    )
    records = ckpt_dir / "health" / f"node-{env.node_rank}-rank-{env.local_rank}.jsonl"
    webhook = os.environ.get(cfg["webhook_env"]) or None
    if env.rank == 0:
        log.info(
            "GPU health watchdog: every %gs (%s)%s",
            cfg["interval_seconds"],
            how,
            ", webhook set" if webhook else "",
        )
    context = {"run": run, "node": env.node_rank, "rank": env.rank}
    return Watchdog(
        reader, index, cfg["interval_seconds"], limits, records, webhook, context
    ).start()


def report_unhealthy(
    watchdog: Watchdog | None, env: WorkerEnv, ckpt_dir: Path, step: int | None
) -> None:
    """Gather the failing GPUs' messages on rank 0 and write checkpoints/health/fatal.json."""
    import torch.distributed as dist

    from snaketune.core.collective import is_distributed

    mine = watchdog.fatal if watchdog is not None else None
    messages = [mine]
    if is_distributed():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, mine)
    if env.rank == 0:
        found = list(dict.fromkeys(m for m in messages if m))
        (ckpt_dir / "health").mkdir(exist_ok=True)
        (ckpt_dir / "health" / "fatal.json").write_text(
            json.dumps({"step": step, "messages": found}, indent=2) + "\n"
        )
        log.error(
            "GPU health: stopped at step %s after saving a checkpoint: %s", step, "; ".join(found)
        )

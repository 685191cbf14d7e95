"""A recording stand-in for `qai_hub.Client`, for tests and `mobc hub ... --dry-run`.

`FakeQaiHub` has the method names and keyword arguments of qai_hub 0.56's Client
(submit_compile_job, submit_link_job, submit_inference_job, get_devices, get_job, config),
records every call with its arguments exactly as passed, and returns jobs shaped like
qai_hub's: job_id, url, name, wait() -> status with success/failure/message/code,
get_target_model(), download_target_model(filename) and download_profile(filename).
It raises qai_hub's own exception types with qai_hub's own messages for the failure modes
(no client.ini, network down, unknown device), so `RealHubClient` is tested unchanged.
`RecordingHubClient` is RealHubClient over a FakeQaiHub.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolchain.hub.client import RealHubClient

DEFAULT_DEVICES: dict[str, tuple[str, tuple[str, ...]]] = {
    # name -> (os, attributes), attribute strings as AI Hub reports them
    "Samsung Galaxy S24 (Family)": (
        "14",
        (
            "chipset:qualcomm-snapdragon-8gen3",
            "framework:qnn",
            "framework:onnx",
            "htp-supports-weight-sharing:true",
            "hexagon:v75",
            "os:android",
        ),
    ),
    "Samsung Galaxy S25 (Family)": (
        "15",
        (
            "chipset:qualcomm-snapdragon-8-elite",
            "framework:qnn",
            "framework:onnx",
            "htp-supports-weight-sharing:true",
            "hexagon:v79",
            "os:android",
        ),
    ),
    "Samsung Galaxy S21": (
        "12",
        ("chipset:qualcomm-snapdragon-888", "framework:qnn", "framework:onnx", "os:android"),
    ),
}

_EXT = {"qnn_context_binary": ".bin", "qnn_dlc": ".dlc", "precompiled_qnn_onnx": ".onnx.zip", "onnx": ".onnx"}


def fake_profile(inference_us: float, layers: list[tuple[str, str, float]] | None = None) -> dict[str, Any]:
    """A profile dict in the shape qai_hub's InferenceJob.download_profile() returns.

    Shape source: qai_hub 0.56 `client._profile_pb_to_python_dict` (major_version 1, minor >= 2):
    {"execution_summary": {"estimated_inference_time": us, ..., "all_inference_times": [us...]},
     "execution_detail": [{"name", "type", "compute_unit", "execution_time" (us), "execution_cycles"}]}.
    """
    t = int(round(inference_us))
    detail = [
        {
            "name": n,
            "type": op,
            "compute_unit": "NPU",
            "execution_time": int(us),
            "execution_cycles": int(us * 1000),
        }
        for n, op, us in (layers or [])
    ]
    return {
        "execution_summary": {
            "estimated_inference_time": t,
            "estimated_inference_peak_memory": 512 * 2**20,
            "first_load_time": 250_000,
            "first_load_peak_memory": 600 * 2**20,
            "warm_load_time": 40_000,
            "warm_load_peak_memory": 520 * 2**20,
            "compile_time": 0,
            "compile_peak_memory": 0,
            "compile_memory_increase_range": None,
            "compile_memory_peak_range": None,
            "first_load_memory_increase_range": [0, 600 * 2**20],
            "first_load_memory_peak_range": [0, 600 * 2**20],
            "warm_load_memory_increase_range": [0, 520 * 2**20],
            "warm_load_memory_peak_range": [0, 520 * 2**20],
            "inference_memory_increase_range": [0, 8 * 2**20],
            "inference_memory_peak_range": [0, 512 * 2**20],
            "all_compile_times": [],
            "all_first_load_times": [250_000],
            "all_warm_load_times": [40_000],
            "all_inference_times": [t, t + 10, t - 10],
        },
        "execution_detail": detail,
    }


@dataclass
class FakeStatus:
    success: bool
    message: str | None = None

    @property
    def failure(self) -> bool:
        return not self.success

    @property
    def code(self) -> str:
        return "SUCCESS" if self.success else "FAILED"


@dataclass
class FakeModel:
    model_id: str
    name: str
    ext: str

    def download(self, filename: str) -> str:
        path = filename if filename.endswith(self.ext) else filename + self.ext
        Path(path).write_bytes(b"fake " + self.model_id.encode())
        return path


@dataclass
class FakeJob:
    job_id: str
    name: str
    job_type: str
    fails: str | None = None  # the failure message, or None when the job succeeds
    target_ext: str = ""
    profile: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        return f"https://workbench.aihub.qualcomm.com/jobs/{self.job_id}/"

    def wait(self, timeout: int | None = None) -> FakeStatus:
        return FakeStatus(self.fails is None, self.fails)

    def get_target_model(self) -> FakeModel | None:
        if self.fails is not None or not self.target_ext:
            return None
        return FakeModel("m" + self.job_id[1:], self.name, self.target_ext)

    def download_target_model(self, filename: str) -> str | None:
        model = self.get_target_model()
        return model.download(filename) if model else None

    def download_profile(self, filename: str | None = None) -> dict | str:
        if self.fails is not None or self.profile is None:
            return {}
        if filename is None:
            return self.profile
        path = filename if filename.endswith(".json") else filename + ".json"
        Path(path).write_text(json.dumps(self.profile))
        return path


@dataclass
class FakeQaiHub:
    configured: bool = True
    reachable: bool = True
    devices: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=lambda: dict(DEFAULT_DEVICES))
    fail_jobs: dict[str, str] = field(default_factory=dict)  # job name -> failure message
    profile_us: dict[str, float] = field(default_factory=dict)  # job name -> estimated_inference_time
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    jobs: dict[str, FakeJob] = field(default_factory=dict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def _guard(self) -> None:
        from qai_hub.client import InternalError, UserError

        if not self.configured:
            raise UserError(
                "Failed to load client configuration file.\n| ~/.qai_hub/client.ini not found. Please request "
                "access at https://aihub.qualcomm.com/. |"
            )
        if not self.reachable:
            raise InternalError(
                "Internal API failure.\n| Could not connect to Qualcomm AI Hub. Please visit "
                "https://workbench.aihub.qualcomm.com to check the service's status. |"
            )

    def _check_device(self, device: Any) -> None:
        from qai_hub.client import UserError

        if device.name not in self.devices:
            raise UserError(f"{device} is not available.")

    def _new_job(self, name: str, job_type: str, ext: str = "") -> FakeJob:
        job = FakeJob(
            job_id=f"j{next(self._ids):08d}",
            name=name,
            job_type=job_type,
            fails=self.fail_jobs.get(name),
            target_ext=ext,
            profile=fake_profile(self.profile_us.get(name, 1000.0)) if job_type == "inference" else None,
        )
        self.jobs[job.job_id] = job
        return job

    # ---- the qai_hub.Client surface mobc uses -----------------------------------------------

    @property
    def config(self) -> dict[str, str]:
        if not self.configured:
            self._guard()
        return {"api_url": "https://workbench.aihub.qualcomm.com"}

    def get_devices(
        self, name: str = "", os: str = "", attributes: str | list[str] | None = None
    ) -> list[Any]:
        import qai_hub

        self._guard()
        self.calls.append(("get_devices", {"name": name}))
        return [qai_hub.Device(n, o, list(a)) for n, (o, a) in self.devices.items() if not name or n == name]

    def submit_compile_job(
        self,
        model,
        device,
        name=None,
        input_specs=None,
        options="",
        single_compile=True,
        calibration_data=None,
        retry=True,
        project=None,
    ):
        self._guard()
        self._check_device(device)
        self.calls.append(
            (
                "submit_compile_job",
                {
                    "model": model,
                    "device": device,
                    "name": name,
                    "input_specs": input_specs,
                    "options": options,
                },
            )
        )
        runtime = (
            options.split("--target_runtime", 1)[1].split()[0] if "--target_runtime" in options else "onnx"
        )
        return self._new_job(name or Path(str(model)).stem, "compile", _EXT.get(runtime, ".bin"))

    def submit_link_job(self, models, device, name=None, options="", project=None):
        self._guard()
        self._check_device(device)
        self.calls.append(
            (
                "submit_link_job",
                {"models": [m.model_id for m in models], "device": device, "name": name, "options": options},
            )
        )
        return self._new_job(name or "link", "link", ".bin")

    def submit_inference_job(
        self, model, device, inputs=None, name=None, options="", retry=True, profile=True, project=None
    ):
        self._guard()
        self._check_device(device)
        model_ref = model.model_id if isinstance(model, FakeModel) else model
        self.calls.append(
            (
                "submit_inference_job",
                {
                    "model": model_ref,
                    "device": device,
                    "inputs": inputs,
                    "name": name,
                    "options": options,
                    "profile": profile,
                },
            )
        )
        return self._new_job(name or "inference", "inference")

    def get_job(self, job_id: str, job_type: Any = None) -> FakeJob:
        from qai_hub.client import UserError

        self._guard()
        if job_id not in self.jobs:
            raise UserError(f"Job {job_id} not found.")
        return self.jobs[job_id]


class RecordingHubClient(RealHubClient):
    """RealHubClient over a FakeQaiHub; `.calls` lists the qai_hub calls made, in order."""

    def __init__(self, fake: FakeQaiHub | None = None, **fake_options: Any):
        self.fake = fake or FakeQaiHub(**fake_options)
        super().__init__(backend=self.fake)

    @property
    def calls(self) -> list[tuple[str, dict[str, Any]]]:
        return self.fake.calls

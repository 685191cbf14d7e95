"""A small client over Qualcomm AI Hub (`qai-hub`): compile, link, profile, inference, download.

`HubClient` is the interface the CLI and CI use; `RealHubClient` implements it over a
`qai_hub.Client` (or anything with the same methods: tests pass the recording fake in
toolchain/hub/fake.py, so the exact qai_hub calls are what the tests check).

Every failure a user can meet becomes a `HubError` (a MobcError, so the CLI prints it and
exits 2) that says what to do:
- no token configured (qai_hub raises UserError as soon as ~/.qai_hub/client.ini is missing)
  or a rejected token -> HubNotConfiguredError
- the service cannot be reached (qai_hub raises InternalError "Could not connect")
  -> HubUnreachableError
- a job failed on the service, or waiting timed out -> HubJobFailedError
- the device name is not one AI Hub knows -> HubDeviceError

Profiling uses `submit_inference_job(..., profile=True)`: `submit_profile_job` is
deprecated in qai-hub 0.56 and only forwards there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from toolchain.errors import MobcError

CONFIGURE_HINT = (
    "get an API token at https://workbench.aihub.qualcomm.com/account/ and run "
    "`qai-hub configure --api_token <TOKEN>` (or point QAIHUB_CLIENT_INI at a client.ini)"
)
LIST_DEVICES_HINT = (
    'run `qai-hub list-devices` and pass one of its names, e.g. --device "Samsung Galaxy S24 (Family)"'
)
WEIGHT_SHARING_ATTR = "htp-supports-weight-sharing:true"
RUNTIMES = ("qnn_context_binary", "qnn_dlc", "precompiled_qnn_onnx")  # AI Hub --target_runtime values

# (shape, dtype) per input name, the form qai_hub's input_specs accepts.
InputSpecs = dict[str, tuple[tuple[int, ...], str]]


class HubError(MobcError):
    """Qualcomm AI Hub could not do what was asked."""


class HubNotConfiguredError(HubError):
    """No usable AI Hub API token."""


class HubUnreachableError(HubError):
    """The AI Hub service cannot be reached."""


class HubJobFailedError(HubError):
    """A job failed on AI Hub (or did not finish in time)."""


class HubDeviceError(HubError):
    """AI Hub does not offer the requested device."""


@dataclass(frozen=True)
class HubDevice:
    name: str
    os: str = ""
    attributes: tuple[str, ...] = ()

    @property
    def supports_weight_sharing(self) -> bool:
        return WEIGHT_SHARING_ATTR in self.attributes

    @property
    def chipset(self) -> str:
        for a in self.attributes:
            if a.startswith("chipset:"):
                return a.split(":", 1)[1]
        return ""


@dataclass
class HubJob:
    job_id: str
    kind: str  # compile / link / inference / profile
    name: str
    url: str = ""
    handle: Any = field(default=None, repr=False, compare=False)  # the qai_hub Job object

    def record(self) -> dict[str, str]:
        """What the manifest keeps: enough to find the job again with `get_job`."""
        return {"job_id": self.job_id, "kind": self.kind, "name": self.name, "url": self.url}


class HubClient(Protocol):
    def check_configured(self) -> None: ...
    def device(self, name: str) -> HubDevice: ...
    def submit_compile(
        self, model: Path, device: HubDevice, *, name: str, options: str, input_specs: InputSpecs | None
    ) -> HubJob: ...
    def submit_link(
        self, jobs: list[HubJob], device: HubDevice, *, name: str, options: str = ""
    ) -> HubJob: ...
    def submit_profile(
        self, model: HubJob | Path, device: HubDevice, *, name: str, options: str = ""
    ) -> HubJob: ...
    def submit_inference(
        self,
        model: HubJob | Path,
        device: HubDevice,
        inputs: dict[str, list[Any]],
        *,
        name: str,
        options: str = "",
    ) -> HubJob: ...
    def wait(self, job: HubJob, timeout: float | None = None) -> None: ...
    def get_job(self, job_id: str, kind: str = "") -> HubJob: ...
    def download_target_model(self, job: HubJob, dest: Path) -> Path: ...
    def download_profile(self, job: HubJob, dest: Path) -> Path: ...


def _detail(exc: BaseException) -> str:
    """qai_hub boxes its messages in drawing characters; keep the words only."""
    text = re.sub(r"[┌┐└┘─│|]", " ", str(exc))
    return re.sub(r"\s+", " ", text).strip()


def client_ini() -> Path:
    """Where qai_hub reads its token: $QAIHUB_CLIENT_INI, else ~/.qai_hub/client.ini."""
    default = os.path.join("~", ".qai_hub", "client.ini")
    return Path(os.path.expanduser(os.environ.get("QAIHUB_CLIENT_INI", default)))


def token_configured() -> bool:
    """Whether a client.ini exists where qai_hub looks for it (no network)."""
    return client_ini().is_file()


@contextmanager
def translate_errors(action: str) -> Iterator[None]:
    """Turn qai_hub / network exceptions raised while doing `action` into HubErrors."""
    from qai_hub.client import Error as QaiHubError
    from qai_hub.client import InternalError, UserError

    try:
        yield
    except HubError:
        raise
    except UserError as e:
        msg = str(e)
        if "client configuration" in msg or "configuration file" in msg or "API token is missing" in msg:
            raise HubNotConfiguredError(
                f"cannot {action}: no Qualcomm AI Hub API token is configured ({client_ini()} is missing "
                f"or incomplete); {CONFIGURE_HINT}"
            ) from None
        if "Failed to authenticate" in msg:
            raise HubNotConfiguredError(
                f"cannot {action}: AI Hub rejected the API token (bad or expired); {CONFIGURE_HINT}"
            ) from None
        if "is not available" in msg or "does not support" in msg:
            raise HubDeviceError(f"cannot {action}: {_detail(e)}; {LIST_DEVICES_HINT}") from None
        raise HubError(f"cannot {action}: AI Hub refused the request: {_detail(e)}") from None
    except InternalError as e:
        if "Could not connect" in str(e) or "Timeout" in str(e) or "unavailable" in str(e):
            raise HubUnreachableError(
                f"cannot {action}: Qualcomm AI Hub is unreachable ({_detail(e)}); check the network "
                "(and HTTPS_PROXY), then retry"
            ) from None
        raise HubError(f"cannot {action}: AI Hub failed internally: {_detail(e)}") from None
    except QaiHubError as e:
        raise HubError(f"cannot {action}: {_detail(e)}") from None
    except OSError as e:
        import requests

        # requests' errors (refused, DNS, TLS, timeouts) are OSErrors; so are local file errors
        if isinstance(e, requests.exceptions.RequestException | ConnectionError | TimeoutError):
            raise HubUnreachableError(
                f"cannot {action}: network error ({e}); check the network, then retry"
            ) from None
        raise HubError(f"cannot {action}: {e}") from None


class RealHubClient:
    """HubClient over `qai_hub.Client` (created on first use, so importing mobc stays offline)."""

    def __init__(self, backend: Any = None, verbose: bool = False):
        self._backend = backend
        self.verbose = verbose

    @property
    def backend(self) -> Any:
        if self._backend is None:
            import qai_hub

            self._backend = qai_hub.Client()
        return self._backend

    # ---- set-up ---------------------------------------------------------------------------

    def check_configured(self) -> None:
        """Fail fast, before any work: loading the config reads client.ini and touches no network."""
        with translate_errors("use Qualcomm AI Hub"):
            self.backend.config  # noqa: B018 - the property raises UserError when no token is set

    def device(self, name: str) -> HubDevice:
        with translate_errors(f"look up device {name!r}"):
            found = self.backend.get_devices(name=name)
        if not found:
            raise HubDeviceError(f"AI Hub has no device named {name!r}; {LIST_DEVICES_HINT}")
        d = found[-1]  # newest OS last, as qai_hub lists them
        return HubDevice(name=d.name, os=d.os, attributes=tuple(d.attributes))

    def _device(self, device: HubDevice) -> Any:
        import qai_hub

        # name + os pins one device; attributes would over-constrain the match
        return qai_hub.Device(name=device.name, os=device.os)

    def _model(self, model: HubJob | Path, action: str) -> Any:
        if isinstance(model, Path):
            return str(model)
        target = self._handle(model).get_target_model()
        if target is None:
            raise HubJobFailedError(
                f"cannot {action}: {model.kind} job {model.job_id} produced no model (it failed); see {model.url}"
            )
        return target

    def _handle(self, job: HubJob) -> Any:
        if job.handle is None:  # a job recorded in a manifest by an earlier run
            job.handle = self.backend.get_job(job.job_id)
        return job.handle

    @staticmethod
    def _job(handle: Any, kind: str, name: str) -> HubJob:
        if isinstance(handle, list):  # qai_hub returns a list only for several devices
            handle = handle[0]
        return HubJob(
            job_id=handle.job_id, kind=kind, name=name, url=getattr(handle, "url", ""), handle=handle
        )

    # ---- jobs -----------------------------------------------------------------------------

    def submit_compile(
        self, model: Path, device: HubDevice, *, name: str, options: str, input_specs: InputSpecs | None
    ) -> HubJob:
        action = f"submit the compile job for {name}"
        with translate_errors(action):
            handle = self.backend.submit_compile_job(
                model=str(model),
                device=self._device(device),
                name=name,
                input_specs=input_specs,
                options=options,
            )
        return self._job(handle, "compile", name)

    def submit_link(self, jobs: list[HubJob], device: HubDevice, *, name: str, options: str = "") -> HubJob:
        action = f"submit the link job for {name}"
        with translate_errors(action):
            models = [self._model(j, action) for j in jobs]
            handle = self.backend.submit_link_job(
                models, device=self._device(device), name=name, options=options
            )
        return self._job(handle, "link", name)

    def submit_profile(
        self, model: HubJob | Path, device: HubDevice, *, name: str, options: str = ""
    ) -> HubJob:
        return self._submit_inference(model, device, None, name, options, profile=True)

    def submit_inference(
        self,
        model: HubJob | Path,
        device: HubDevice,
        inputs: dict[str, list[Any]],
        *,
        name: str,
        options: str = "",
    ) -> HubJob:
        return self._submit_inference(model, device, inputs, name, options, profile=False)

    def _submit_inference(
        self,
        model: HubJob | Path,
        device: HubDevice,
        inputs: dict[str, list[Any]] | None,
        name: str,
        options: str,
        profile: bool,
    ) -> HubJob:
        """Profiling is an inference job with profile=True (submit_profile_job is deprecated)."""
        kind = "profile" if profile else "inference"
        action = f"submit the {kind} job for {name}"
        with translate_errors(action):
            handle = self.backend.submit_inference_job(
                model=self._model(model, action),
                device=self._device(device),
                inputs=inputs,
                name=name,
                options=options,
                profile=profile,
            )
        return self._job(handle, kind, name)

    def get_job(self, job_id: str, kind: str = "") -> HubJob:
        with translate_errors(f"find job {job_id}"):
            handle = self.backend.get_job(job_id)
        return HubJob(
            job_id,
            kind or getattr(handle, "job_type", ""),
            getattr(handle, "name", ""),
            getattr(handle, "url", ""),
            handle,
        )

    def wait(self, job: HubJob, timeout: float | None = None) -> None:
        with translate_errors(f"wait for {job.kind} job {job.job_id}"):
            try:
                status = self._handle(job).wait(timeout=None if timeout is None else int(timeout))
            except TimeoutError:
                raise HubJobFailedError(
                    f"{job.kind} job {job.job_id} ({job.name}) did not finish within {timeout:.0f} s; it is still "
                    f"running at {job.url}; re-run later (the job id is recorded) or raise --timeout"
                ) from None
        if not status.success:
            raise HubJobFailedError(
                f"AI Hub {job.kind} job {job.job_id} ({job.name}) failed: {status.message or status.code}; "
                f"the log is at {job.url}"
            )

    # ---- downloads ------------------------------------------------------------------------

    def download_target_model(self, job: HubJob, dest: Path) -> Path:
        self.wait(job)
        with translate_errors(f"download the model of {job.kind} job {job.job_id}"):
            got = self._handle(job).download_target_model(str(dest))
        if got is None:
            raise HubJobFailedError(
                f"{job.kind} job {job.job_id} has no target model to download; see {job.url}"
            )
        return Path(got)  # qai_hub adds the right extension (.bin, .dlc, ...) to dest

    def download_profile(self, job: HubJob, dest: Path) -> Path:
        self.wait(job)
        with translate_errors(f"download the profile of job {job.job_id}"):
            got = self._handle(job).download_profile(str(dest))
        if not isinstance(got, str):  # qai_hub returns {} when the job produced no profile
            raise HubJobFailedError(f"job {job.job_id} produced no profile; see {job.url}")
        return Path(got)

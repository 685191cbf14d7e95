"""The AI Hub client: exact qai_hub calls (through the recording fake) and clear failures."""

from __future__ import annotations

import inspect
import json

import pytest
import qai_hub

from toolchain.errors import MobcError
from toolchain.hub.client import (
    HubDeviceError,
    HubJob,
    HubJobFailedError,
    HubNotConfiguredError,
    HubUnreachableError,
    RealHubClient,
    token_configured,
)
from toolchain.hub.fake import FakeQaiHub, RecordingHubClient

S24 = "Samsung Galaxy S24 (Family)"


def test_fake_matches_the_real_qai_hub_signatures():
    # If qai-hub renames or reorders these keywords, the fake (and so the tests) must follow.
    for meth in ("submit_compile_job", "submit_link_job", "submit_inference_job", "get_devices", "get_job"):
        real = list(inspect.signature(getattr(qai_hub.Client, meth)).parameters)[1:]
        fake = list(inspect.signature(getattr(FakeQaiHub, meth)).parameters)[1:]
        assert fake == real, meth


def test_device_lookup_and_weight_sharing():
    hub = RecordingHubClient()
    dev = hub.device(S24)
    assert dev.name == S24 and dev.supports_weight_sharing
    assert dev.chipset == "qualcomm-snapdragon-8gen3"
    assert not hub.device("Samsung Galaxy S21").supports_weight_sharing
    with pytest.raises(HubDeviceError, match="qai-hub list-devices"):
        hub.device("Pixel 1")


def test_compile_link_profile_download(tmp_path):
    hub = RecordingHubClient(profile_us={"smollm2_decode_profile": 26000.0})
    dev = hub.device(S24)
    specs = {"input_ids": ((1, 1), "int32"), "attention_mask": ((1, 1, 1, 512), "float32")}
    c1 = hub.submit_compile(
        tmp_path / "decode.onnx",
        dev,
        name="smollm2_decode",
        options="--target_runtime qnn_dlc --qnn_graph_name decode",
        input_specs=specs,
    )
    c2 = hub.submit_compile(
        tmp_path / "prefill.onnx",
        dev,
        name="smollm2_prefill",
        options="--target_runtime qnn_dlc --qnn_graph_name prefill",
        input_specs=None,
    )
    link = hub.submit_link([c1, c2], dev, name="smollm2_linked")
    prof = hub.submit_profile(
        link, dev, name="smollm2_decode_profile", options="--qnn_options context_enable_graphs=decode"
    )

    names = [c[0] for c in hub.calls]
    assert names == [
        "get_devices",
        "submit_compile_job",
        "submit_compile_job",
        "submit_link_job",
        "submit_inference_job",
    ]
    compile_kw = hub.calls[1][1]
    assert compile_kw["model"] == str(tmp_path / "decode.onnx")
    assert compile_kw["device"] == qai_hub.Device(name=S24, os="14")
    assert compile_kw["input_specs"] == specs
    assert compile_kw["options"] == "--target_runtime qnn_dlc --qnn_graph_name decode"
    link_kw = hub.calls[3][1]
    assert link_kw["models"] == ["m" + c1.job_id[1:], "m" + c2.job_id[1:]]  # the compile jobs' target models
    inf_kw = hub.calls[4][1]
    assert inf_kw["profile"] is True and inf_kw["inputs"] is None  # not the deprecated submit_profile_job
    assert inf_kw["model"] == "m" + link.job_id[1:]

    binary = hub.download_target_model(link, tmp_path / "smollm2")
    assert binary == tmp_path / "smollm2.bin" and binary.is_file()
    pfile = hub.download_profile(prof, tmp_path / "decode_profile")
    assert pfile.suffix == ".json"
    assert json.loads(pfile.read_text())["execution_summary"]["estimated_inference_time"] == 26000
    assert link.record() == {"job_id": link.job_id, "kind": "link", "name": "smollm2_linked", "url": link.url}


def test_jobs_recorded_in_a_manifest_can_be_found_again(tmp_path):
    hub = RecordingHubClient()
    dev = hub.device(S24)
    job = hub.submit_compile(
        tmp_path / "m.onnx", dev, name="m", options="--target_runtime qnn_context_binary", input_specs=None
    )
    again = hub.get_job(job.job_id, "compile")
    assert again.handle is job.handle
    restored = HubJob(**job.record())  # no handle: the client fetches it by id
    assert hub.download_target_model(restored, tmp_path / "m").suffix == ".bin"


def test_inference_job_passes_inputs(tmp_path):
    hub = RecordingHubClient()
    dev = hub.device(S24)
    hub.submit_inference(tmp_path / "m.bin", dev, {"input_ids": [[1, 2]]}, name="check")
    kw = hub.calls[-1][1]
    assert (
        kw["profile"] is False
        and kw["inputs"] == {"input_ids": [[1, 2]]}
        and kw["model"] == str(tmp_path / "m.bin")
    )


def test_failed_job_says_where_the_log_is(tmp_path):
    hub = RecordingHubClient(fail_jobs={"bad": "Failed to compile: op GatherND is not supported"})
    dev = hub.device(S24)
    job = hub.submit_compile(tmp_path / "m.onnx", dev, name="bad", options="", input_specs=None)
    with pytest.raises(HubJobFailedError, match="GatherND is not supported.*jobs/"):
        hub.wait(job)
    with pytest.raises(HubJobFailedError):
        hub.download_target_model(job, tmp_path / "out")
    with pytest.raises(HubJobFailedError, match="produced no model"):
        hub.submit_link([job], dev, name="link")


@pytest.mark.parametrize(
    "fake, error, hint",
    [
        (FakeQaiHub(configured=False), HubNotConfiguredError, "qai-hub configure --api_token"),
        (FakeQaiHub(reachable=False), HubUnreachableError, "unreachable"),
    ],
)
def test_setup_failures_become_clear_errors(tmp_path, fake, error, hint):
    hub = RecordingHubClient(fake)
    with pytest.raises(error, match=hint):
        hub.device(S24)
    assert issubclass(error, MobcError)


def test_unknown_device_at_submit_time(tmp_path):
    hub = RecordingHubClient()
    from toolchain.hub.client import HubDevice

    with pytest.raises(HubDeviceError, match="is not available.*list-devices"):
        hub.submit_compile(
            tmp_path / "m.onnx", HubDevice("Galaxy S99"), name="m", options="", input_specs=None
        )


def test_check_configured_fails_fast_without_a_token(monkeypatch, tmp_path):
    # The real qai_hub client, no client.ini: UserError from reading the config, no network.
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "missing.ini"))
    assert not token_configured()
    with pytest.raises(HubNotConfiguredError, match="qai-hub configure --api_token"):
        RealHubClient().check_configured()
    RecordingHubClient().check_configured()  # configured fake: no error


def test_translation_of_qai_hub_errors():
    # Messages as qai_hub 0.56 words them (seen offline: a missing client.ini; a closed port, after
    # ~45 s of qai_hub's own retries, which is why no test here talks to a real socket).
    from qai_hub.client import InternalError, UserError

    from toolchain.hub.client import HubError, translate_errors

    cases = [
        (
            UserError("Failed to authenticate.\n| bad or expired API token |"),
            HubNotConfiguredError,
            "rejected",
        ),
        (
            InternalError("Internal API failure.\n| Could not connect to Qualcomm AI Hub. |"),
            HubUnreachableError,
            "unreachable",
        ),
        (
            InternalError("Internal API failure.\n| Qualcomm AI Hub reported errors. |"),
            HubError,
            "internally",
        ),
        (UserError("Model file is too large"), HubError, "refused the request: Model file is too large"),
        (ConnectionRefusedError(111, "refused"), HubUnreachableError, "network error"),
        (PermissionError(13, "Permission denied"), HubError, "Permission denied"),
    ]
    for exc, error, text in cases:
        with pytest.raises(error, match=text) as caught:
            with translate_errors("do it"):
                raise exc
        if isinstance(exc, PermissionError):  # a local file problem is not a network problem
            assert not isinstance(caught.value, HubUnreachableError)

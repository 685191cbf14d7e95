"""`mobc hub compile|profile|calibrate`: Qualcomm AI Hub jobs for an artifact folder.

Errors are MobcErrors (HubError, ArtifactError, DeviceProfileError): `mobc` prints the message
and exits 2. `--dry-run` runs the whole job plan against the recording fake and prints the exact
qai_hub calls, writing nothing; it needs no token (useful in CI without the secret).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from toolchain.cli.common import console
from toolchain.hub.client import RUNTIMES

app = typer.Typer(
    no_args_is_help=True,
    help="Qualcomm AI Hub: compile, link and profile on real phones; "
    "calibrate the cost model from the profiles.",
)

DEFAULT_DEVICE = "Samsung Galaxy S24 (Family)"
_ARTIFACT = typer.Argument(..., help="artifact folder written by mobc compile (or its quantized/ folder)")
_DEVICE = typer.Option(DEFAULT_DEVICE, "--device", help="AI Hub device name (see `qai-hub list-devices`)")
_DRY = typer.Option(
    False, "--dry-run", help="print the qai_hub calls that would be made; submit nothing, write nothing"
)
_TIMEOUT = typer.Option(
    None, "--timeout", help="seconds to wait for each job (default: until AI Hub finishes it)"
)


def _client(dry_run: bool):
    if dry_run:
        from toolchain.hub.fake import RecordingHubClient

        return RecordingHubClient()
    from toolchain.hub.client import RealHubClient

    return RealHubClient()


def _print_calls(client) -> None:
    console.print("[bold]dry run[/]: qai_hub calls that would be made (nothing submitted or written)")
    for name, kwargs in client.calls:
        shown = {
            k: (str(v) if not isinstance(v, str | int | float | bool | type(None) | list | dict) else v)
            for k, v in kwargs.items()
        }
        console.print(f"  {name}({json.dumps(shown, default=str)})", highlight=False, soft_wrap=True)


@app.command("compile")
def compile_cmd(
    artifact: Path = _ARTIFACT,
    device: str = _DEVICE,
    runtime: str = typer.Option(
        "qnn_context_binary", "--runtime", help=f"AI Hub target runtime: {', '.join(RUNTIMES)}"
    ),
    link: bool | None = typer.Option(
        None,
        "--link/--no-link",
        help="link widths into one weight-sharing binary (default: when the device supports weight sharing)",
    ),
    options: str = typer.Option(
        "", "--options", help="extra AI Hub compile flags, e.g. '--qairt_version 2.40'"
    ),
    encodings: bool = typer.Option(
        True, "--encodings/--no-encodings", help="upload AIMET encodings with quantized graphs"
    ),
    timeout: float | None = _TIMEOUT,
    dry_run: bool = _DRY,
) -> None:
    """Compile every graph on AI Hub for DEVICE; binaries land in ARTIFACT/hub/<device>/."""
    from toolchain.hub.jobs import hub_compile

    client = _client(dry_run)
    record = hub_compile(
        artifact,
        device,
        client,
        runtime=runtime,
        link=link,
        extra_options=options,
        encodings=encodings,
        timeout=timeout,
        dry_run=dry_run,
        say=console.print,
    )
    if dry_run:
        _print_calls(client)
        return
    files = sorted({m["file"] for m in record["models"].values()})
    console.print(
        f"[bold green]compiled[/] {len(record['compile'])} graphs for {record['device']['name']}"
        + (" (linked)" if record["linked"] else "")
        + f": {', '.join(files)}"
    )


@app.command("profile")
def profile_cmd(
    artifact: Path = _ARTIFACT,
    device: str = _DEVICE,
    options: str = typer.Option(
        "", "--options", help="extra AI Hub profile flags, e.g. '--max_profiler_iterations 50'"
    ),
    timeout: float | None = _TIMEOUT,
    dry_run: bool = _DRY,
) -> None:
    """Profile the compiled graphs on DEVICE; profiles land in ARTIFACT/hub/<device>/profiles/."""
    from toolchain.hub.jobs import hub_profile

    client = _client(dry_run)
    record = None
    if dry_run:
        # the fake knows no compile jobs of an earlier run: plan the compile first, then profile it
        from toolchain.hub.jobs import hub_compile

        record = hub_compile(artifact, device, client, dry_run=True, say=lambda *_: None)
    profiles = hub_profile(
        artifact,
        device,
        client,
        extra_options=options,
        timeout=timeout,
        dry_run=dry_run,
        say=console.print,
        record=record,
    )
    if dry_run:
        _print_calls(client)
        return
    for graph, p in profiles.items():
        console.print(f"{graph}: {p['latency_ms']:.3f} ms on device ({p['file']})")


@app.command("calibrate")
def calibrate_cmd(
    artifact: Path = _ARTIFACT,
    device: str | None = typer.Option(None, "--device", help="device whose AI Hub profiles to use"),
    profile: list[str] = typer.Option(
        [],
        "--profile",
        help="GRAPH=FILE: a local profile (onnxruntime JSON, QNN EP "
        "CSV or AI Hub JSON) of that graph; repeatable",
    ),
    base: str | None = typer.Option(
        None, "--base", help="device profile to start from (default: the device's)"
    ),
    out: Path | None = typer.Option(None, "--out", help="where to write the profile YAML"),
) -> None:
    """Fit the cost model's device profile to measured latencies (offline; no token needed)."""
    from toolchain.hub.client import HubError
    from toolchain.hub.jobs import hub_calibrate

    pairs: dict[str, Path] = {}
    for item in profile:
        graph, sep, file = item.partition("=")
        if not sep or not graph or not file:
            raise HubError(
                f"--profile {item!r}: write it as GRAPH=FILE, e.g. --profile decode=decode_profile.json"
            )
        pairs[graph] = Path(file)
    fitted, path = hub_calibrate(artifact, device, pairs or None, base=base, out=out)
    for m in fitted.calibration["measurements"]:
        console.print(
            f"{m['graph']}: measured {m['measured_ms']:.3f} ms, predicted {m['predicted_before_ms']:.3f}"
            f" -> {m['predicted_after_ms']:.3f} ms ({m['bound']}-bound)"
        )
    for note in fitted.calibration.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")
    console.print(
        f"[bold green]wrote[/] {path} (dram_efficiency {fitted.dram_efficiency}, "
        f"npu_efficiency {fitted.npu_efficiency}); the cost model loads it by path wherever a device "
        "profile is asked for"
    )

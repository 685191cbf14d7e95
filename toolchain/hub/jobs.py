"""AI Hub work on an artifact folder: compile (+ link), profile, calibrate.

Ordering rule: every check that can fail without the service (token configured, manifest
readable, graphs present) runs before anything is submitted, and nothing is written into the
artifact folder until every job has succeeded: graphs are staged for upload in a system temp
folder, results are downloaded into a hidden sibling folder and renamed to hub/<device>/ at
the end, then the manifest records the jobs (ids, options, input specs) under "hub".

Upload form (qai_hub 0.56 `_get_model_dir_type`): a folder holding exactly one .onnx, at most
one .data (external weights) and one .encodings; a folder named *.aimet with encodings is an
AIMET model. The artifact's shared weights.bin cannot be uploaded as is (a .bin next to an
.onnx means "QNN context binary" to AI Hub), so each graph is re-saved with its own .data.

Linking: graphs of several widths share every weight; on a device with weight sharing
(attribute htp-supports-weight-sharing:true) each is compiled to a QNN DLC and the DLCs that
cover the same layers are linked into one context binary, as ai-hub-models does for its
prompt/token graphs; profiling a graph of a linked binary selects it with
`--qnn_options context_enable_graphs=<graph>`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from toolchain.artifact.manifest import GraphRecord, Manifest
from toolchain.errors import ArtifactError
from toolchain.hub.client import RUNTIMES, HubClient, HubError, HubJob, InputSpecs

HUB_DIR = "hub"
_DTYPES = {
    "float": "float32",
    "float32": "float32",
    "int32": "int32",
    "int64": "int64",
    "int8": "int8",
    "int16": "int16",
    "uint8": "uint8",
    "uint16": "uint16",
}


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def input_specs(graph: GraphRecord) -> InputSpecs:
    specs: InputSpecs = {}
    for i in graph.inputs:
        dtype = _DTYPES.get(i.dtype)
        if dtype is None or not all(isinstance(d, int) for d in i.shape):
            raise HubError(
                f"graph {graph.name}: input {i.name} is {i.dtype} {i.shape}; AI Hub takes static "
                f"shapes of {', '.join(sorted(set(_DTYPES.values())))}; change the graph's inputs"
            )
        specs[i.name] = (tuple(i.shape), dtype)
    return specs


def is_quantized(manifest: Manifest) -> bool:
    return manifest.quantization is not None or any(g.encodings for g in manifest.graphs)


def compile_options(graph: GraphRecord, runtime: str, quantized: bool, extra: str = "") -> str:
    """AI Hub compile flags for one graph (the flag set ai-hub-models uses for its LLM parts)."""
    opts = [f"--target_runtime {runtime}"]
    if runtime in ("qnn_context_binary", "qnn_dlc"):
        opts.append(f"--qnn_graph_name {graph.name}")
    opts.append("--output_names " + ",".join(o.name for o in graph.outputs))
    if quantized:
        opts.append("--quantize_io")  # keep the QDQ graph's integer I/O instead of float wrappers
    if any(i.dtype == "int64" for i in graph.inputs + graph.outputs):
        opts.append("--truncate_64bit_io")
    if extra.strip():
        opts.append(extra.strip())
    return " ".join(opts)


def link_groups(graphs: list[GraphRecord]) -> dict[str, list[GraphRecord]]:
    """Graphs that hold the same weights (same stage of a split, same layers): one binary each."""
    groups: dict[str, list[GraphRecord]] = {}
    for g in graphs:
        key = "lm_head" if g.role == "lm_head" else f"stage{g.stage}"
        layers = g.meta.get("layers")
        if layers:
            key += "_layers" + "-".join(str(x) for x in layers)
        groups.setdefault(key, []).append(g)
    return groups


def stage_graph(artifact: Path, graph: GraphRecord, tmp: Path, with_encodings: bool) -> Path:
    """Write <graph>.onnx with its own .data (and .encodings) in tmp; returns what to upload."""
    import onnx_ir as ir

    enc = artifact / graph.encodings if with_encodings and graph.encodings else None
    folder = tmp / (graph.name + (".aimet" if enc else ""))
    folder.mkdir(parents=True)
    model = ir.load(artifact / graph.file)
    ir.save(model, folder / f"{graph.name}.onnx", external_data=f"{graph.name}.data")
    if enc is not None:
        shutil.copyfile(enc, folder / f"{graph.name}.encodings")
    files = list(folder.iterdir())
    return files[0] if len(files) == 1 else folder


def _load(artifact: Path, client: HubClient) -> Manifest:
    # first the artifact (local, instant: a folder that is no artifact is named as such), then the token,
    # before any upload
    manifest = Manifest.load(artifact)
    client.check_configured()
    missing = [g.file for g in manifest.graphs if not (artifact / g.file).is_file()]
    if missing:
        raise ArtifactError(f"{artifact}: graph files missing: {', '.join(missing)}; recompile the recipe")
    return manifest


def _replace_dir(staging: Path, dest: Path) -> None:
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    staging.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def _staging(dest: Path) -> Path:
    tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _save_record(artifact: Path, manifest: Manifest, slug: str, record: dict[str, Any]) -> None:
    prefix = f"{HUB_DIR}/{slug}/"
    known = {k: v for k, v in manifest.files.items() if not k.startswith(prefix)}
    manifest.hub = {**(manifest.hub or {}), slug: record}
    manifest.write(artifact, known_sha=known)  # the big files did not change; only hub/<slug>/ is re-hashed


def _specs_record(specs: InputSpecs) -> dict[str, Any]:
    return {k: [list(shape), dtype] for k, (shape, dtype) in specs.items()}


def hub_compile(
    artifact: Path,
    device_name: str,
    client: HubClient,
    runtime: str = "qnn_context_binary",
    link: bool | None = None,
    extra_options: str = "",
    encodings: bool = True,
    timeout: float | None = None,
    dry_run: bool = False,
    say: Any = print,
) -> dict[str, Any]:
    """Compile (and link) every graph of the artifact on AI Hub; download into hub/<device>/."""
    if runtime not in RUNTIMES:
        raise HubError(f"unknown runtime {runtime!r}; use one of {', '.join(RUNTIMES)}")
    artifact = Path(artifact)
    manifest = _load(artifact, client)
    device = client.device(device_name)
    slug = device_slug(device.name)
    quantized = is_quantized(manifest)
    graphs = manifest.graphs
    groups = link_groups(graphs)
    can_link = runtime == "qnn_context_binary" and any(len(v) > 1 for v in groups.values())
    if link and not can_link:
        raise HubError("--link needs --runtime qnn_context_binary and graphs of several widths to link")
    if link and not device.supports_weight_sharing:
        raise HubError(
            f"{device.name} does not support weight sharing, so graphs cannot be linked; pass --no-link"
        )
    do_link = can_link and device.supports_weight_sharing if link is None else bool(link)
    compile_runtime = "qnn_dlc" if do_link else runtime

    jobs: dict[str, HubJob] = {}
    rec_compile: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mobc-hub-") as tmp:
        for g in graphs:
            specs = input_specs(g)
            opts = compile_options(g, compile_runtime, quantized, extra_options)
            if dry_run:
                upload = Path(tmp) / f"{g.name}.onnx"
            else:
                upload = stage_graph(artifact, g, Path(tmp), with_encodings=encodings and quantized)
            job = client.submit_compile(
                upload, device, name=f"{manifest.name}_{g.name}", options=opts, input_specs=specs
            )
            say(f"compile {g.name}: job {job.job_id} {job.url}")
            jobs[g.name] = job
            rec_compile[g.name] = {**job.record(), "options": opts, "input_specs": _specs_record(specs)}
    for job in jobs.values():
        client.wait(job, timeout)

    rec_link: dict[str, Any] = {}
    producers: dict[str, tuple[HubJob, str]] = {}  # graph -> (job whose target model holds it, file stem)
    if do_link:
        for key, members in groups.items():
            name = f"{manifest.name}_{key}"
            job = client.submit_link([jobs[g.name] for g in members], device, name=name)
            say(f"link {', '.join(g.name for g in members)}: job {job.job_id} {job.url}")
            client.wait(job, timeout)
            rec_link[key] = {**job.record(), "graphs": [g.name for g in members]}
            for g in members:
                producers[g.name] = (job, name)
    else:
        producers = {n: (j, n) for n, j in jobs.items()}

    record: dict[str, Any] = {
        "device": {"name": device.name, "os": device.os, "attributes": list(device.attributes)},
        "runtime": runtime,
        "linked": do_link,
        "quantized": quantized,
        "compile": rec_compile,
        "link": rec_link,
        "models": {},
    }
    for graph, (job, _stem) in producers.items():
        record["models"][graph] = {"file": None, "job_id": job.job_id, "kind": job.kind, "graph_name": graph}
    if dry_run:
        return record
    dest = artifact / HUB_DIR / slug
    staging = _staging(dest)
    try:
        files: dict[str, str] = {}
        for graph, (job, stem) in producers.items():
            if stem not in files:
                files[stem] = client.download_target_model(job, staging / stem).name
            record["models"][graph]["file"] = f"{HUB_DIR}/{slug}/{files[stem]}"
        _replace_dir(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _save_record(artifact, manifest, slug, record)
    return record


def _device_record(manifest: Manifest, device_name: str | None) -> tuple[str, dict[str, Any]]:
    hub = (manifest.hub or {})
    if device_name is None:
        if len(hub) == 1:
            return next(iter(hub.items()))
        raise HubError(
            f"name the device with --device (this artifact has AI Hub results for: {', '.join(hub) or 'none'})"
        )
    slug = device_slug(device_name)
    if slug not in hub:
        raise HubError(
            f"no AI Hub compile of this artifact for {device_name!r}; run `mobc hub compile ARTIFACT "
            f'--device "{device_name}"` first'
        )
    return slug, hub[slug]


def hub_profile(
    artifact: Path,
    device_name: str | None,
    client: HubClient,
    extra_options: str = "",
    timeout: float | None = None,
    dry_run: bool = False,
    say: Any = print,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Profile every compiled graph on the device; profiles land in hub/<device>/profiles/."""
    from toolchain.cost.calibrate import read_latency

    artifact = Path(artifact)
    manifest = _load(artifact, client)
    if record is None:
        slug, record = _device_record(manifest, device_name)
    else:  # a compile record not (yet) in the manifest: the dry-run plan
        slug = device_slug(record["device"]["name"])
    device = client.device(record["device"]["name"])
    jobs: dict[str, tuple[HubJob, str]] = {}
    for graph, model in record["models"].items():
        opts = f"--qnn_options context_enable_graphs={model['graph_name']}" if record["linked"] else ""
        opts = " ".join(x for x in (opts, extra_options.strip()) if x)
        producer = HubJob(model["job_id"], model["kind"], graph)
        job = client.submit_profile(
            producer, device, name=f"{manifest.name}_{graph}_profile", options=opts
        )
        say(f"profile {graph}: job {job.job_id} {job.url}")
        jobs[graph] = (job, opts)
    for job, _ in jobs.values():
        client.wait(job, timeout)
    profiles: dict[str, Any] = {g: {**j.record(), "options": o} for g, (j, o) in jobs.items()}
    if dry_run:
        return profiles
    dest = artifact / HUB_DIR / slug / "profiles"
    staging = _staging(dest)
    try:
        for graph, (job, _) in jobs.items():
            path = client.download_profile(job, staging / graph)
            latency, _, units = read_latency(path)
            profiles[graph].update(
                file=f"{HUB_DIR}/{slug}/profiles/{path.name}",
                latency_ms=round(latency * 1e3, 4),
                compute_units=units,
            )
        _replace_dir(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    record["profile"] = profiles
    _save_record(artifact, manifest, slug, record)
    return profiles


def _base_for(record: dict[str, Any] | None, device_name: str | None) -> Any:
    """The built-in profile for the device: by its AI Hub name, else by its chipset attribute."""
    from toolchain.cost.model import DeviceProfileError, available_profiles, load_profile

    dev = record["device"] if record else {"name": device_name, "attributes": []}
    if dev["name"] is None:
        raise HubError(
            "say which device the profiles come from: --base snapdragon-8-gen-3 (or --device NAME)"
        )
    chipsets = [a.split(":", 1)[1] for a in dev.get("attributes", []) if a.startswith("chipset:")]
    for name in [dev["name"], *chipsets]:
        try:
            return load_profile(name)
        except DeviceProfileError:
            continue
    raise HubError(
        f"no built-in device profile matches {dev['name']!r}; pass --base with one of "
        f"{', '.join(available_profiles())} (the closest chipset)"
    )


def hub_calibrate(
    artifact: Path,
    device_name: str | None = None,
    profiles: dict[str, Path] | None = None,
    base: str | None = None,
    out: Path | None = None,
) -> tuple[Any, Path]:
    """Fit a device profile to measured latencies of the artifact's graphs (offline; no token needed).

    profiles: graph name -> profile file (AI Hub JSON, onnxruntime trace, QNN EP CSV); by default
    the AI Hub profiles `mobc hub profile` recorded for the device.
    """
    from toolchain.cost.calibrate import calibrate, measure
    from toolchain.cost.model import load_profile, save_profile
    from toolchain.cost.onnx_graph import graph_cost

    artifact = Path(artifact)
    manifest = Manifest.load(artifact)
    by_name = {g.name: g for g in manifest.graphs}
    record: dict[str, Any] | None = None
    if profiles:
        slug = device_slug(device_name) if device_name else "local"
        if device_name and device_slug(device_name) in (manifest.hub or {}):
            record = manifest.hub[slug]
    else:
        slug, record = _device_record(manifest, device_name)
        if not record.get("profile"):
            raise HubError(
                "no profiles recorded for this device; run `mobc hub profile` first (or pass --profile)"
            )
        profiles = {g: artifact / p["file"] for g, p in record["profile"].items()}
    unknown = sorted(set(profiles) - set(by_name))
    if unknown:
        raise HubError(f"no graph named {', '.join(unknown)} in this artifact; graphs: {', '.join(by_name)}")
    base_profile = load_profile(base) if base else _base_for(record, device_name)
    ms = [measure(g, p, graph_cost(artifact / by_name[g].file)) for g, p in profiles.items()]
    fitted = calibrate(base_profile, ms, name=f"{slug}-measured")
    if out is None:
        (artifact / HUB_DIR / slug).mkdir(parents=True, exist_ok=True)
        out = artifact / HUB_DIR / slug / "device_profile.yaml"
    save_profile(fitted, out, base=base_profile.name)
    if out.resolve().is_relative_to(artifact.resolve()) and slug in (manifest.hub or {}):
        manifest.hub[slug]["calibration"] = {
            "file": str(out.resolve().relative_to(artifact.resolve())),
            "dram_efficiency": fitted.dram_efficiency,
            "npu_efficiency": fitted.npu_efficiency,
        }
        _save_record(artifact, manifest, slug, manifest.hub[slug])
    return fitted, out

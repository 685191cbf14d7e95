"""Property-based fuzzing of the command line (issue 17): random recipes (YAML trees, wrong types,
out-of-range numbers, unknown passes and options, odd unicode, deep nesting, binary files) and argument
combinations of `mobc compile`, `mobc run` and `mobc adapter pack`. Every input must end in success
or one clear message with exit code 2 (never a traceback), write nothing outside the requested
output and leave no manifest after a failure.

The normal suite runs a bounded, derandomized number of examples (about 30 s on 2 cores). The long
run: MOBC_FUZZ_EXAMPLES=2000 pytest tests/toolchain/cli/test_fuzz.py -s (random seeds, prints how many
inputs each property tried; valid recipes over the tiny model are then drawn too, so some compile).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.cli_main import run_main  # noqa: E402

LONG = int(os.environ.get("MOBC_FUZZ_EXAMPLES", "0"))
TRIED: Counter[str] = Counter()


def fuzz_settings(bounded: int):
    return settings(
        max_examples=LONG or bounded,
        deadline=None,
        database=None,
        derandomize=not LONG,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    if LONG:
        print(f"\nfuzz inputs tried: {dict(TRIED)}")


# ---- strategies ------------------------------------------------------------------------------------
ODD_TEXT = st.one_of(
    st.text(max_size=24),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12),
    st.sampled_from(
        [
            "",
            " ",
            "tiny",
            "名前",
            "\u202eevil",
            "é" * 40,
            "..",
            "../..",
            "/",
            "~",
            "a\x00b",
            "[bold]x[/]",
            "{targets: [q_proj]}",
            "x" * 300,
            "\n",
            "- a",
            "*ref",
            "!!python/object",
        ]
    ),
)
NUMBERS = st.one_of(
    st.integers(-3, 600),
    st.sampled_from([0, -1, 2**31, 2**63, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["8", "1e3", "eight", True, None]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, ODD_TEXT)
TREES = st.recursive(
    SCALARS,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(ODD_TEXT | st.integers(), kids, max_size=4),
    max_leaves=16,
)
PASS_NAMES = [
    "fold_constants",
    "mha_to_sha",
    "linear_to_conv",
    "split_lm_head",
    "split_layers",
    "lora_inputs",
    "scale_rmsnorm",
    "split_parts",
    "check_htp",
    "no_such_pass",
    "FOLD_CONSTANTS",
]
PASSES = (
    st.lists(
        st.sampled_from(PASS_NAMES)
        | st.dictionaries(
            st.sampled_from(PASS_NAMES),
            st.dictionaries(ODD_TEXT, TREES, max_size=3) | TREES,
            min_size=1,
            max_size=2,
        )
        | TREES,
        max_size=4,
    )
    | TREES
)
GRAPH = st.fixed_dictionaries(
    {"width": NUMBERS, "context": NUMBERS},
    optional={
        "role": st.sampled_from(["decode", "prefill", "tree", "diffusion", "custom", "lm_head"]) | TREES,
        "bogus": TREES,
    },
)
SMALL_GRAPH = st.builds(lambda w, c: {"width": w, "context": c}, st.integers(1, 4), st.integers(48, 64))


def recipe_dicts(sources: st.SearchStrategy) -> st.SearchStrategy:
    graphs = (
        st.dictionaries(
            st.sampled_from(["decode", "prefill", "tree", "Bad Name", "x9"]) | ODD_TEXT,
            GRAPH | TREES,
            max_size=3,
        )
        | TREES
    )
    return st.fixed_dictionaries(
        {
            "name": st.sampled_from(["tiny", "t-1", "fuzz"]) | ODD_TEXT | TREES,
            "source": sources,
            "graphs": graphs,
        },
        optional={
            "passes": PASSES,
            "tolerance": st.fixed_dictionaries({"max_abs": NUMBERS}) | TREES,
            "verify": st.fixed_dictionaries({"greedy_tokens": NUMBERS, "prompt": ODD_TEXT}) | TREES,
            "quantize": st.fixed_dictionaries({"weights": ODD_TEXT, "activations": NUMBERS}) | TREES,
            "qnn": st.fixed_dictionaries({"soc_model": NUMBERS, "htp_arch": NUMBERS}) | TREES,
            "output": ODD_TEXT | TREES,
            "bogus_key": TREES,
        },
    )


def deep(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ("{a: " * depth + "1" + "}" * depth)


# ---- sandbox -------------------------------------------------------------------------------------
def snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st_ = p.lstat()
            out[str(p.relative_to(root))] = (
                st_.st_mode,
                st_.st_size if not p.is_dir() else 0,
                st_.st_mtime_ns,
                os.readlink(p) if p.is_symlink() else None,
            )
    return out


def changed(before: dict, after: dict) -> set[str]:
    return {k for k in set(before) | set(after) if before.get(k) != after.get(k)}


def under(rel: str, allowed: list[str]) -> bool:
    return any(rel == a or rel.startswith(a + os.sep) or a.startswith(rel + os.sep) for a in allowed)


def check(r, sandbox: Path, before: dict, allowed: list[str], what: str) -> None:
    """The properties every input must have."""
    assert r.code in (0, 2), f"{what}: exit {r.code}\n{r.err[-3000:]}"
    assert "Traceback" not in r.err + r.out, f"{what}: traceback\n{r.err[-3000:]}"
    if r.code == 2:
        assert "error:" in r.err or "Usage:" in r.err or "Invalid value" in r.err, (
            f"{what}: no message\n{r.err}"
        )
    moved = changed(before, snapshot(sandbox))
    outside = sorted(m for m in moved if not under(m, allowed))
    assert not outside, f"{what}: wrote outside the requested output: {outside[:5]}\n{r.err[-500:]}"
    if r.code != 0:
        left = [m for m in moved if os.path.basename(m) == "manifest.json"]
        assert not left, f"{what}: a failure left {left}"


@pytest.fixture(scope="module")
def sandbox_files(tmp_path_factory):
    """Things recipes can point at: a folder that is no model, a garbage .gguf."""
    root = tmp_path_factory.mktemp("fuzz_inputs")
    (root / "not-a-model").mkdir()
    (root / "not-a-model" / "readme.txt").write_text("x")
    (root / "garbage.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(40)))
    return root


# ---- mobc compile ------------------------------------------------------------------------------
def _compile_case(data, tiny_source: Path, inputs: Path) -> None:
    sandbox = Path(tempfile.mkdtemp(prefix="fuzz-compile-"))
    try:
        (sandbox / "precious").mkdir()
        (sandbox / "precious" / "important.txt").write_text("x")
        (sandbox / "afile").write_text("x")
        (sandbox / "link").symlink_to(sandbox / "precious", target_is_directory=True)
        recipe = sandbox / "r.yaml"
        form = data["form"]
        if form == "binary":
            recipe.write_bytes(data["blob"])
        elif form == "deep":
            recipe.write_text(
                f"name: deep\nsource: {{path: x}}\ngraphs: {deep(data['depth'], data['deep_kind'])}\n"
            )
        elif form == "text":
            recipe.write_text(data["text"])
        else:
            tree = data["recipe"]
            recipe.write_text(
                yaml.safe_dump(tree, allow_unicode=True, sort_keys=False)
                if not isinstance(tree, str)
                else tree
            )
        args = ["compile", "recipe-folder" if form == "folder" else recipe]
        if form == "folder":
            (sandbox / "recipe-folder").mkdir()
        out = data["out"]
        if out is not None:
            args += ["--out", sandbox / out]
        if data["force"]:
            args.append("--force")
        allowed = [out] if out is not None else []
        rec = data.get("recipe")
        if isinstance(rec, dict):  # the recipe's own output, or exported/<name>, relative to the cwd
            if isinstance(rec.get("output"), str) and "\x00" not in rec["output"]:
                allowed.append(os.path.relpath(os.path.abspath(sandbox / rec["output"]), sandbox))
            if isinstance(rec.get("name"), str):
                allowed.append(os.path.join("exported", rec["name"]))
        before = snapshot(sandbox)
        cwd = os.getcwd()
        os.chdir(sandbox)
        try:
            r = run_main(*args)
        finally:
            os.chdir(cwd)
        TRIED["compile"] += 1
        TRIED[f"compile exit {r.code}"] += 1
        check(r, sandbox, before, [a for a in allowed if not a.startswith("..")], f"compile {data}")
        assert (sandbox / "precious" / "important.txt").read_text() == "x"
    finally:
        shutil.rmtree(sandbox, ignore_errors=True)


# real passes, with options right and wrong, for the valid recipes of the long run (each one compiles)
REAL_PASSES = st.sampled_from(
    [
        "fold_constants",
        "split_lm_head",
        "mha_to_sha",
        "scale_rmsnorm",
        "linear_to_conv",
        "check_htp",
        {"split_layers": {"at": [1]}},
        {"split_layers": {"at": [0]}},
        {"split_layers": {"at": [99]}},
        {"split_layers": {"at": []}},
        {"lora_inputs": {"targets": ["q_proj"], "max_rank": 4}},
        {"lora_inputs": {"targets": ["nope"], "max_rank": 0}},
        {"split_parts": {"max_part_bytes": -1}},
        {"split_parts": {"max_part_bytes": 1000}},
        {"linear_to_conv": {"keep_layout": "bogus"}},
        {"rescale_residual": {}},
        {"forecast_inputs": {}},
    ]
)


def compile_inputs(tiny_source: Path, inputs: Path, with_valid: bool) -> st.SearchStrategy:
    bad_sources = (
        st.sampled_from(
            [
                {"path": str(inputs / "missing")},
                {"path": str(inputs / "not-a-model")},
                {"gguf": str(inputs / "garbage.gguf")},
                {"hub": "nobody/not-cached"},
                {"package": "no-such-package"},
                {"path": "x", "gguf": "y"},
                {"hub": "a/b", "revision": "main", "made_by": "`mobc train draft`"},
                {"path": str(inputs / "missing"), "made_by": "`mobc train x` (1 minute)"},
            ]
        )
        | st.dictionaries(
            st.sampled_from(["path", "gguf", "hub", "package", "revision", "made_by", "bogus"]),
            ODD_TEXT | TREES,
            max_size=3,
        )
        | TREES
    )
    valid = st.fixed_dictionaries(
        {
            "name": st.just("fuzz-ok"),
            "source": st.just({"path": str(tiny_source)}),
            "graphs": st.dictionaries(
                st.sampled_from(["decode", "prefill"]), SMALL_GRAPH, min_size=1, max_size=2
            ),
            "verify": st.sampled_from([{"greedy_tokens": 0}, {"greedy_tokens": 2}]),
            "passes": st.lists(REAL_PASSES, max_size=3),
        },
        optional={"output": ODD_TEXT, "tolerance": st.just({"max_abs": 1.0e-9})},
    )
    recipes = recipe_dicts(bad_sources) | TREES
    if with_valid:
        recipes = st.one_of(recipes, recipes, recipes, valid)
    return st.fixed_dictionaries(
        {
            "form": st.sampled_from(["yaml", "yaml", "yaml", "yaml", "text", "binary", "deep", "folder"]),
            "recipe": recipes,
            "text": ODD_TEXT,
            "blob": st.binary(min_size=1, max_size=64).filter(lambda b: not _utf8(b)),
            "depth": st.sampled_from([50, 500, 5000]),
            "deep_kind": st.sampled_from(["list", "dict"]),
            "out": st.sampled_from([None, "out", "out/nested", "precious", "afile", "link", "", "."]),
            "force": st.booleans(),
        }
    )


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_fuzz_compile(tiny_source, sandbox_files):
    @fuzz_settings(60)
    @given(compile_inputs(tiny_source, sandbox_files, with_valid=bool(LONG)))
    def prop(data):
        _compile_case(data, tiny_source, sandbox_files)

    prop()


# ---- mobc run ------------------------------------------------------------------------------------
RUN_OPTIONS = {
    "--max-new-tokens": NUMBERS.map(str) | st.integers(0, 40).map(str),
    "--temperature": st.sampled_from(["0", "0.7", "-1", "nan", "inf", "1e-30", "abc", "1e308"]),
    "--policy": st.sampled_from(
        [
            "ar",
            "chain",
            "lever",
            "ahasd",
            "ctg",
            "ds2d",
            "llada",
            "dllm",
            "fastdllm",
            "lever+prune",
            "ar+x",
            "bogus",
            "",
        ]
    ),
    "--draft": st.sampled_from(["good", "missing", "empty"]),
    "--gamma": st.sampled_from(["0", "1", "3", "-2", "x"]),
    "--seed": st.sampled_from(["0", "7", "-1", str(2**64)]),
    "--threads": st.sampled_from(["1", "2", "0", "-1"]),
    "--adapter": st.sampled_from(["a", "base", "../x", "missing.npz"]),
    "--forecast": st.sampled_from(["missing.npz", "garbage.npz"]),
    "--provider": st.sampled_from(["cpu", "bogus", "CPU"]),
    "--ep-option": st.sampled_from(["a=b", "novalue", "=", "soc_model=57"]),
}


def test_fuzz_run(tiny_artifact):
    @fuzz_settings(25)
    @given(
        st.sampled_from(["good", "good", "good", "missing", "empty", "file"]),
        ODD_TEXT | st.sampled_from(["def f(x):", "import os\n"]),
        st.dictionaries(st.sampled_from(sorted(RUN_OPTIONS)), st.none(), max_size=4).flatmap(
            lambda keys: st.fixed_dictionaries({k: RUN_OPTIONS[k] for k in keys})
        ),
        st.booleans(),
    )
    def prop(which, prompt, options, chat):
        sandbox = Path(tempfile.mkdtemp(prefix="fuzz-run-"))
        try:
            (sandbox / "empty").mkdir()
            (sandbox / "file").write_text("x")
            (sandbox / "garbage.npz").write_bytes(b"PK\x03\x04garbage")
            where = {
                "good": tiny_artifact,
                "missing": sandbox / "missing",
                "empty": sandbox / "empty",
                "file": sandbox / "file",
            }
            args = ["run", where[which], "--prompt", prompt]
            for key, value in options.items():
                if key == "--draft":
                    value = where.get(value, sandbox / value)
                elif key == "--forecast":
                    value = sandbox / value
                args += [key, value]
            if chat:
                args.append("--chat")
            before, art_before = snapshot(sandbox), snapshot(tiny_artifact)
            r = run_main(*args)
            TRIED["run"] += 1
            TRIED[f"run exit {r.code}"] += 1
            check(r, sandbox, before, [], f"run {args}")
            assert snapshot(tiny_artifact) == art_before, f"run {args} changed the artifact"
        finally:
            shutil.rmtree(sandbox, ignore_errors=True)

    prop()


# ---- mobc adapter pack ------------------------------------------------------------------------------
def _safetensors(tensors: dict) -> bytes:
    import numpy as np
    from safetensors.numpy import save

    return save({k: np.ones(shape, np.float32) for k, shape in tensors.items()})


KEYS = st.sampled_from(
    [
        f"base_model.model.model.layers.{i}.self_attn.{p}.lora_{ab}.weight"
        for i in (0, 1, 7)
        for p in ("q_proj", "v_proj", "o_proj")
        for ab in "AB"
    ]
    + ["bogus", "lm_head.lora_A.weight"]
)
SHAPES = st.lists(st.integers(0, 70), min_size=1, max_size=3).map(tuple) | st.sampled_from([(4, 64), (64, 4)])
CONFIGS = st.one_of(
    st.fixed_dictionaries(
        {"peft_type": st.sampled_from(["LORA", "IA3"]) | TREES},
        optional={
            "r": NUMBERS,
            "lora_alpha": NUMBERS,
            "use_rslora": TREES,
            "rank_pattern": TREES,
            "alpha_pattern": TREES,
            "bias": TREES,
            "base_model_name_or_path": ODD_TEXT | TREES,
            "modules_to_save": TREES,
            "use_dora": TREES,
        },
    ).map(json.dumps),
    TREES.map(lambda t: json.dumps(t, default=str)),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
)


@pytest.fixture(scope="module")
def lora_manifest_artifact(tiny_artifact, tmp_path_factory):
    """The tiny artifact, recorded as compiled with lora_inputs (pack reads only the manifest)."""
    art = tmp_path_factory.mktemp("fuzz_pack") / "artifact"
    shutil.copytree(tiny_artifact, art)
    m = json.loads((art / "manifest.json").read_text())
    m["passes"].append(
        {"pass": "lora_inputs", "options": {"targets": ["q_proj", "v_proj"], "max_rank": 8, "slots": 1}}
    )
    (art / "manifest.json").write_text(json.dumps(m))
    return art


def _valid_adapter(rank: int) -> dict:
    layer = "base_model.model.model.layers.0.self_attn"
    return {
        f"{layer}.{p}.lora_{ab}.weight": (rank, 64) if ab == "A" else (64, rank)
        for p in ("q_proj", "v_proj")
        for ab in "AB"
    }


VALID_CONFIG = st.builds(
    lambda r: json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r}), st.integers(1, 8)
)
MUTATED_CONFIG = st.builds(  # a valid config with one field replaced
    lambda r, key, value: json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, key: value}, default=str
    ),
    st.integers(1, 8),
    st.sampled_from(
        [
            "r",
            "lora_alpha",
            "rank_pattern",
            "alpha_pattern",
            "use_rslora",
            "bias",
            "use_dora",
            "base_model_name_or_path",
            "modules_to_save",
            "peft_type",
            "lora_bias",
        ]
    ),
    TREES | st.dictionaries(ODD_TEXT, NUMBERS, max_size=2),
)


def test_fuzz_adapter_pack(lora_manifest_artifact):
    art = lora_manifest_artifact

    @fuzz_settings(40)
    @given(
        st.one_of(CONFIGS, VALID_CONFIG, MUTATED_CONFIG, MUTATED_CONFIG),
        st.one_of(
            st.none(),
            st.binary(max_size=60),
            st.dictionaries(KEYS, SHAPES, max_size=4),
            st.integers(1, 10).map(_valid_adapter),
            st.integers(1, 10).map(_valid_adapter),
        ),
        st.none() | ODD_TEXT | st.sampled_from(["../evil", "/tmp/mobc-fuzz-evil", "a/b", ".", "ok-name"]),
        st.sampled_from(["folder", "folder", "folder", "missing", "file"]),
    )
    def prop(config, weights, name, peft_kind):
        sandbox = Path(tempfile.mkdtemp(prefix="fuzz-pack-"))
        try:
            peft = sandbox / "peft"
            if peft_kind == "folder":
                peft.mkdir()
                (peft / "adapter_config.json").write_text(config, encoding="utf-8", errors="surrogatepass")
                if isinstance(weights, dict):
                    (peft / "adapter_model.safetensors").write_bytes(_safetensors(weights))
                elif weights is not None:
                    (peft / "adapter_model.safetensors").write_bytes(weights)
            elif peft_kind == "file":
                peft.write_text("x")
            args = ["adapter", "pack", art, peft] + (["--name", name] if name is not None else [])
            before, art_before = snapshot(sandbox), snapshot(art)
            r = run_main(*args)
            TRIED["adapter pack"] += 1
            TRIED[f"adapter pack exit {r.code}"] += 1
            check(r, sandbox, before, [], f"pack {args}")
            moved = changed(art_before, snapshot(art))
            assert all(m == "adapters" or m.startswith("adapters" + os.sep) for m in moved), (
                f"pack {args} wrote outside ARTIFACT/adapters: {sorted(moved)}"
            )
        finally:
            shutil.rmtree(sandbox, ignore_errors=True)
            shutil.rmtree(art / "adapters", ignore_errors=True)

    prop()

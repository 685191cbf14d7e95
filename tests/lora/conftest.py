import pytest

from tests.passes.tiny import ARCHS

M = 2  # forecast slots of the tiny artifact; its tree width (M+1)^2 = 9
GRAPHS = ("  decode: {width: 1, context: 64}\n  prefill: {width: 8, context: 64}\n"
          "  ctg: {width: 4, context: 64, role: tree}\n  tree: {width: 9, context: 64}\n")
PASSES = ("passes:\n  - mha_to_sha\n  - lora_inputs: {targets: [q_proj, v_proj, down_proj], max_rank: 4, slots: 3}\n"
          f"  - forecast_inputs: {{m: {M}}}\n")


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def lora_artifact(tmp_path_factory):
    """(artifact folder, source model folder): tiny llama with mha_to_sha + lora_inputs + forecast_inputs."""
    from tests.tiny import save_tiny, write_recipe
    from toolchain.pipeline import compile_recipe

    tmp = tmp_path_factory.mktemp("lora_rt")
    src = save_tiny(tmp / "src", "llama")
    recipe = write_recipe(tmp / "r.yaml", src, "tiny-lora", GRAPHS, PASSES)
    return compile_recipe(recipe).out_dir, src

"""Recipe section `quantize:` — what to quantize to which precision, and how to calibrate.

    quantize:
      weights: int4                 # int4 | int8
      granularity: per_channel      # per_channel | block (then block_size)
      activations: int16            # int8 | int16 (unsigned on the graph, per QNN HTP convention)
      kv_cache: int8                # past_key_i / new_key_i share one encoding (tied)
      overrides:                    # fnmatch pattern on node names -> precision
        "lm_head*": {weights: int8}
        "*norm*": {activations: int16}
      calibration: {samples: 8, width_tokens: 512}
      method: ptq                   # or qat: PTQ, then learned activation encodings (qat: {steps, feeds, lr})

Every bad value is a pydantic error whose location is the dotted key (quantize.overrides.X.y),
which recipe.py turns into a RecipeError naming that key.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

WeightType = Literal["int4", "int8", "int16", "float"]
ActType = Literal["int8", "int16", "float"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        # pydantic's own "extra inputs are not permitted" does not say what *is* permitted
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                raise ValueError(f"unknown key {unknown[0]!r}; valid keys here are: {', '.join(cls.model_fields)}")
        return data


class Override(_Strict):
    """Precision for the nodes whose name matches a pattern (their weights / output activations)."""

    weights: WeightType | None = None
    activations: ActType | None = None
    granularity: Literal["per_channel", "per_tensor", "block"] | None = None


class Calibration(_Strict):
    samples: Annotated[int, Field(ge=1, le=512, description="step-graph calls per graph family")] = 8
    seed: int = 0
    method: Literal["minmax"] = "minmax"


class QatSpec(_Strict):
    """Graph QAT (graph_qat.py): the QDQ graph's free 8-bit activation encodings are learned."""

    steps: Annotated[int, Field(ge=1, le=5000)] = 60
    feeds: Annotated[int, Field(ge=1, le=256, description="step-graph calls of calibration text")] = 8
    lr: Annotated[float, Field(gt=0, le=1.0)] = 1e-2  # Adam on log range multipliers: ~1% per step
    temperature: Annotated[float, Field(gt=0)] = 1.0
    max_seconds: Annotated[float, Field(gt=0)] = 240.0


class QuantizeSpec(_Strict):
    method: Literal["ptq", "qat"] = "ptq"
    weights: Literal["int4", "int8"] = "int4"
    granularity: Literal["per_channel", "block"] = "per_channel"
    block_size: Annotated[int, Field(ge=16, le=4096)] | None = None
    activations: Literal["int8", "int16"] = "int16"
    kv_cache: Literal["int8", "int16"] | None = None  # default: the activation type
    embedding: Literal["int8", "int16", "float"] = "int16"
    overrides: dict[str, Override] = Field(default_factory=dict)
    calibration: Calibration = Calibration()
    qat: QatSpec | None = None
    # weights already on a block grid of the recipe's type and block size (GGUF Q4_0/Q4_1/Q8_0
    # sources) keep their exact codes instead of being rounded a second time (source_grid.py)
    source_grid: bool = True
    # int4 block weights of MatMuls with 8-bit inputs as LPBQ (per-channel scale x 4-bit block scales),
    # the form QNN HTP accepts there (lpbq.py); not exact: the change is recorded per weight
    lpbq: bool = False
    # attention products of two 16-bit activations as Mul + ReduceSum (decode, tree) or over an 8-bit
    # hi/lo split of the second input (prefill), which QNN HTP computes at 16-bit precision (its
    # 16x16 MatMul rounds the second input to 8 bits); exact in real arithmetic (htp_precise.py)
    htp_precise: bool = True
    # the residual stream (its Adds, the RMSNorms reading it) and outlier tensors in float, fp16 on the
    # HTP: one token's massive activation otherwise coarsens every token's 16-bit residual grid
    # (float_residual.py); outlier_ratio: a tensor whose range exceeds that many times the median of
    # the same tensor in the other layers goes float too (0: none)
    float_residual: bool = False
    outlier_ratio: Annotated[float, Field(ge=0)] = 16.0
    eval_tokens: Annotated[int, Field(ge=0, le=65536)] = 1024  # held-out tokens for the compile report's ppl

    @model_validator(mode="after")
    def _consistent(self) -> QuantizeSpec:
        if self.granularity == "block":
            if self.block_size is None:
                raise ValueError("granularity: block needs block_size (e.g. 32, 64 or 128)")
            if self.block_size & (self.block_size - 1):
                raise ValueError(f"block_size must be a power of two (got {self.block_size})")
        elif self.block_size is not None:
            raise ValueError("block_size only applies with granularity: block")
        if self.lpbq and (self.granularity != "block" or self.weights != "int4"):
            raise ValueError("lpbq: true rewrites int4 block weights; use weights: int4, granularity: block")
        if self.method == "ptq" and self.qat is not None:
            raise ValueError("a `qat:` section needs method: qat")
        for pattern, ov in self.overrides.items():
            if not pattern.strip():
                raise ValueError("an override pattern is empty; use fnmatch patterns like 'lm_head*'")
            if ov.weights is None and ov.activations is None and ov.granularity is None:
                raise ValueError(f"override {pattern!r} sets nothing; give weights, activations or granularity")
        return self

    @property
    def kv_type(self) -> str:
        return self.kv_cache or self.activations

    @property
    def qat_spec(self) -> QatSpec:
        return self.qat or QatSpec()

    def tag(self) -> str:
        """Short scheme name used in reports: w4a16, w4a8-qat, ..."""
        w = self.weights.removeprefix("int")
        a = self.activations.removeprefix("int")
        return f"w{w}a{a}" + ("-qat" if self.method == "qat" else "")

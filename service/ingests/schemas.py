"""Ingest requests."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from service.errors import RequestBody

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"


class IngestCreate(RequestBody):
    """Run ``corpus`` through ``model`` and store its head features under ``name``."""

    model: str = Field(
        min_length=1,
        max_length=500,
        description="hub id or local directory of a transformers model (encoder, decoder or both)",
    )
    name: str = Field(
        min_length=1,
        max_length=200,
        pattern=NAME_PATTERN,
        description="unique catalog name: letters, digits, '.', '_', '-'",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/\-]*$",
        description="hub models: the branch, tag or commit to load (e.g. step1000); stored with the commit it "
        "resolves to",
    )
    series: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        pattern=NAME_PATTERN,
        description="the series this checkpoint is a step of (made by its first step); needs step",
    )
    step: int | None = Field(default=None, ge=0, le=2**31 - 1, description="the checkpoint's training step")
    corpus: str = Field(
        default="builtin:wiki",
        min_length=1,
        max_length=500,
        description="builtin:wiki | builtin:lee | SQuAD .json | GLUE .tsv | .jsonl | .txt | hub:NAME",
    )
    samples: int = Field(default=1000, ge=1, le=10_000_000)
    max_length: int | None = Field(
        default=None, ge=8, le=8192,
        description="tokens per sample (truncation); default: 128, or the model's positions where it has fewer",
    )  # fmt: skip
    batch_size: int = Field(default=32, ge=1, le=4096)
    num_windows: int = Field(default=16, ge=1, le=512)
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] | None = Field(
        default=None, description="spread a model larger than one device over several (accelerate); replaces device"
    )
    prepend_bos: bool = Field(
        default=True, description="causal models whose tokenizer adds no start token get the model's BOS first"
    )
    add_run: bool = Field(default=False, description="add a feature run to a model already in the catalog")
    refuse_malformed: bool = Field(
        default=False,
        description="refuse a GLUE .tsv with malformed lines (fields unlike the header's); else they are left out",
    )

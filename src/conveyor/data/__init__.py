"""Data sets: vendored math sets, reasoning-gym tasks and user files as :class:`~conveyor.types.Sample`.

Entry point: ``load_dataset("mawps:singleop:train")``; the spec grammar is documented in
:mod:`conveyor.data.registry`, the vendored files in ``conveyor/data/files/README.md``.
"""

from conveyor.data.registry import (
    DATA_DIR,
    HELDOUT_FRACTION,
    RG_DEFAULT_SEED,
    RG_DEFAULT_SIZE,
    RG_HELDOUT_SEED_OFFSET,
    DatasetError,
    DatasetLoad,
    format_number,
    list_datasets,
    load_dataset,
    load_dataset_report,
    parse_gsm8k_answer,
)

__all__ = [
    "DATA_DIR",
    "HELDOUT_FRACTION",
    "RG_DEFAULT_SEED",
    "RG_DEFAULT_SIZE",
    "RG_HELDOUT_SEED_OFFSET",
    "DatasetError",
    "DatasetLoad",
    "format_number",
    "list_datasets",
    "load_dataset",
    "load_dataset_report",
    "parse_gsm8k_answer",
]

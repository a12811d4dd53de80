"""Turning a data-set sample into model input with the tokenizer's own chat template."""

from __future__ import annotations

from conveyor.types import Sample


def resolve_instruction(instruction: str | None, dataset: str) -> str:
    """The instruction appended to each question: ``instruction`` when given (``""`` included:
    no instruction), else the data source's own (:func:`conveyor.data.registry.source_format`:
    numeric sets ask for "the final answer as a number after 'Answer:'", reasoning-gym tasks for
    "the final answer after 'Answer:', in the form the question asks for").

    Args:
        instruction: An explicit instruction, or None for the source's default.
        dataset: The data set spec whose default applies (e.g. ``"rg:spell_backward"``).

    Raises:
        TypeError: If ``dataset`` is not a str (when it is needed).
    """
    if instruction is not None:
        return instruction
    from conveyor.data.registry import default_instruction

    return default_instruction(dataset)


def build_messages(sample: Sample, instruction: str = "") -> list[dict[str, str]]:
    """Chat messages for one sample: a single user turn ``question`` + blank line + ``instruction``."""
    content = sample.question if not instruction else f"{sample.question}\n\n{instruction}"
    return [{"role": "user", "content": content}]


def build_prompt_ids(tokenizer, sample: Sample, instruction: str = "") -> list[int]:
    """Token ids of the chat-formatted prompt (generation prompt appended).

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template (raises ValueError without one).
        sample: The problem.
        instruction: Text appended to the question (e.g. the answer-format instruction).

    Returns:
        Prompt token ids (length P, tokens).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; conveyor formats prompts with the tokenizer's template")
    out = tokenizer.apply_chat_template(
        build_messages(sample, instruction), tokenize=True, add_generation_prompt=True
    )
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)

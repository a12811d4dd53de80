"""Turning a data-set sample into model input with the tokenizer's own chat template."""

from __future__ import annotations

from conveyor.types import Sample


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

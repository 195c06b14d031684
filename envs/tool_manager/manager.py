"""A chat format: its tool-call parser plus prompt and observation rendering through the tokenizer's chat template."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rlfactory_megatron.envs.tool_manager.calls import ParsedTurn

# Placeholder assistant text used to find where the model's own turn ends in a rendering.
_TURN_SENTINEL = "RLF_ASSISTANT_TURN_SENTINEL"


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


@dataclass
class ToolManager:
    """Renders prompts (with tool schemas) and tool observations as token ids, and parses turns.

    Observations are rendered as the template's continuation after an assistant turn, so
    `prompt + generated + observation + generated + ...` tokenizes the same conversation the
    template would render whole; the agent loop appends them with loss_mask 0.
    """

    parser: ToolCallParser
    tokenizer: Any
    end_of_turn: tuple[str, ...]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    call_end_of_turn: str | None = None  # the marker of a turn that calls tools, when not end_of_turn[0]

    def parse(self, text: str) -> ParsedTurn:
        """Parse a generated turn, without the end-of-turn marker the model closed it with."""
        return self.parser.parse(self.strip_end_of_turn(text))

    def strip_end_of_turn(self, text: str) -> str:
        stripped = text.rstrip()
        for marker in self.end_of_turn:
            if stripped.endswith(marker):
                return stripped[: -len(marker)]
        return text

    def ends_turn(self, text: str) -> bool:
        return self.strip_end_of_turn(text) != text

    @property
    def turn_end(self) -> str:
        """The marker the chat template closes an assistant turn with (demonstrations and turns
        the model left open end with it)."""
        return self.end_of_turn[0]

    def turn_end_of(self, calls_tools: bool) -> str:
        """The marker that closes an assistant turn, in generation, demonstrations and turns the
        model left open alike: the format's call marker for one that calls tools (Llama 3:
        <|eom_id|>), else `turn_end`."""
        return self.call_end_of_turn if calls_tools and self.call_end_of_turn else self.turn_end

    def stop_token_ids(self) -> list[int]:
        """Token ids that end a generated turn: every end-of-turn marker of the format that is one
        token (Llama 3: <|eot_id|> and <|eom_id|>), and the tokenizer's EOS. The engine runs
        without a tokenizer, so it knows no EOS of its own."""
        ids = []
        unknown = getattr(self.tokenizer, "unk_token_id", None)
        for marker in self.end_of_turn:
            encoded = self.tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) == 1 and encoded[0] != unknown:
                ids.append(encoded[0])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return list(dict.fromkeys(ids))

    def render_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **self.template_kwargs
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def observation_text(self, observations: list[str], names: list[str] | None = None) -> str:
        """The template text that follows an assistant turn's end marker: tool messages, then the
        next assistant header."""
        tool_messages = [
            {"role": "tool", "content": text, **({"name": names[i]} if names else {})}
            for i, text in enumerate(observations)
        ]
        messages = [
            {"role": "user", "content": "-"},
            {"role": "assistant", "content": _TURN_SENTINEL},
            *tool_messages,
        ]
        full = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.template_kwargs
        )
        turn_at = full.index(_TURN_SENTINEL) + len(_TURN_SENTINEL)
        ends = [(full.find(m, turn_at), m) for m in self.end_of_turn if full.find(m, turn_at) >= 0]
        if not ends:
            raise ValueError(
                f"chat template renders no end-of-turn marker {self.end_of_turn} after an assistant turn; "
                "pick the tool manager that matches the tokenizer's chat format"
            )
        at, marker = min(ends)
        return full[at + len(marker):]

    def render_observation(self, observations: list[str], names: list[str] | None = None) -> list[int]:
        return self.tokenizer.encode(self.observation_text(observations, names), add_special_tokens=False)

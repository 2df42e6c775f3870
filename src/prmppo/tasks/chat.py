"""Prompt text from a list of chat messages: through the tokenizer's chat template, or plain.

`model.chat_template` decides (`auto | true | false`):
  auto   use the template when the model's tokenizer has one (an instruct model), else plain text;
  true   use it, and refuse by name a tokenizer without one;
  false  plain text: the messages' contents joined by a blank line, then `task.prompt_template`.
`model.system_prompt`, when set, is put first as a system message (unless the row brings its own).

With the template the prompt ends with the assistant header (`add_generation_prompt`), so the
response the policy writes, the gold solution SFT teaches and the text the PRM scores all follow it.
Every stage tokenizes `task.format_prompt(problem)` with the tokenizer's defaults (special tokens
added), so a template that writes the BOS token itself has that leading BOS text removed when the
tokenizer adds BOS on its own: the token ids are then exactly `apply_chat_template(..., tokenize=True)`'s.
"""

from __future__ import annotations

from pathlib import Path

from prmppo.errors import ConfigError

CHAT_TEMPLATE_MODES = ("auto", "true", "false")


def chat_template_mode(value) -> str:
    """`value` as one of `CHAT_TEMPLATE_MODES` (the YAML booleans true/false arrive as bool or "True")."""
    mode = str(value).strip().lower()
    if mode not in CHAT_TEMPLATE_MODES:
        raise ConfigError(f"model.chat_template={value!r} is not one of {', '.join(CHAT_TEMPLATE_MODES)}")
    return mode


class ChatPrompts:
    """Renders a problem's messages to the prompt text the policy is conditioned on."""

    def __init__(self, mode, tokenizer_path: str | None, system_prompt: str | None, prompt_template: str):
        self.mode = chat_template_mode(mode)
        self.system_prompt = system_prompt or None
        if "{prompt}" not in prompt_template:
            raise ConfigError(f"task.prompt_template={prompt_template!r} has no {{prompt}} placeholder")
        self.prompt_template = prompt_template
        self.tokenizer = None
        if self.mode != "false" and tokenizer_path:
            from prmppo.models.loading import load_tokenizer  # transformers: only when a template may apply

            self.tokenizer = load_tokenizer(Path(tokenizer_path))
        has_template = self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))
        if self.mode == "true" and not has_template:
            where = f"the tokenizer in {tokenizer_path}" if tokenizer_path else "model=tiny's tokenizer"
            raise ConfigError(f"model.chat_template=true but {where} has no chat template; set "
                              "model.chat_template=auto or false, or give the tokenizer one (the chat_template "
                              "entry of its tokenizer_config.json)")
        self.templated = has_template and self.mode != "false"
        self._strip_bos = self.templated and self._adds_bos(self.tokenizer)

    @staticmethod
    def _adds_bos(tokenizer) -> bool:
        bos = tokenizer.bos_token_id
        return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]

    def messages(self, messages: list[dict]) -> list[dict]:
        """The conversation the prompt renders: the system prompt first when set and the row has none."""
        has_system = bool(messages) and messages[0]["role"] == "system"
        if self.system_prompt and not has_system:
            return [{"role": "system", "content": self.system_prompt}, *messages]
        return list(messages)

    def render(self, messages: list[dict]) -> str:
        """The prompt text of one conversation; the response follows it directly."""
        conversation = self.messages(messages)
        if not self.templated:
            joined = "\n\n".join(m["content"] for m in conversation)
            return self.prompt_template.replace("{prompt}", joined)
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        bos = self.tokenizer.bos_token
        if self._strip_bos and bos and text.startswith(bos):
            text = text[len(bos):]
        return text

"""Small locally trained tokenizers with Qwen- and Llama-3-style chat templates (no hub downloads),
for tiny models: the tests, benchmarks and the embedded default."""

SPECIAL_TOKENS = [
    "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
    "<tool_response>", "</tool_response>",
]

# Written after the shape of Qwen2.5/Qwen3's template: tools listed in the system
# turn, an assistant message's structured `tool_calls` rendered as <tool_call> blocks after its
# content (how TRL and HF chat code hand calls back), tool results grouped into one user turn of
# <tool_response> blocks.
QWEN_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}"
    "{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- elif m.role != 'system' %}"
    "{{- '<|im_start|>' + m.role + '\n' + m.content }}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- for call in m.tool_calls %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{%- if m.content or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{- (call.arguments if call.arguments is string else call.arguments | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# After Llama 3.1's JSON tool-calling template: tools in the system turn, results as `ipython`.
LLAMA3_TEMPLATE = (
    "{{- bos_token + '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{%- if tools %}"
    "{{- 'Environment: ipython\nRespond with a JSON function call {\"name\": function name, \"parameters\": arguments}. Functions:\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\n' }}{%- endfor %}"
    "{%- endif %}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}"
    "{%- elif m.role != 'system' %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)


DEFAULT_CORPUS = [
    "You may call one or more functions to assist with the user query.",
    '{"name": "calculator", "arguments": {"expression": "1 + 2"}}',
    "What is 12 times 7? The answer is 84.",
    'def f(x):\n    return {"key": [1, 2, 3]}',
]


def train_chat_tokenizer(chat_template: str, eos: str, bos: str | None = None, corpus: list[str] = DEFAULT_CORPUS,
                         vocab_size: int = 600, split_words: bool = True, split_digits: bool | None = None):
    """A byte-level BPE tokenizer trained on `corpus` (x20) with SPECIAL_TOKENS as added tokens.

    With `split_digits` (default: as `split_words`), every digit is its own token, as in
    Qwen2/Qwen3's tokenizers: numbers are then copied digit by digit, the same tokens in a prompt,
    a tool call and a tool response. `split_words=False` lets merges cross spaces and punctuation,
    so text repeated in the corpus (a template's scaffolding, a tool schema) becomes a few long
    tokens; with `split_digits` too, numbers still stay digit by digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    split_digits = split_words if split_digits is None else split_digits
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(list(corpus) * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, chat_template=chat_template)

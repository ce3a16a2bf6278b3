"""The data's worth as users measure it: acceptance length of drafters trained on our data, in speculative decoding
against a target that has learned (issue 40; docs/benchmarks.md).

corpus.py  the target's text: the standard library's docstrings and the public ShareGPT sample as chat
           conversations, split into training and held-out items by source item
target.py  `make acceptance-target` (`python -m benchmarks.acceptance.target --size ci|bench`): a dense Llama and its
           tokenizer trained here on the CPU, its held-out prompts and report (perplexity, greedy answers)
data.py    `python -m benchmarks.acceptance.data --target DIR --variant NAME`: the drafters' data made through the
           Dagster definitions (regenerated answers -> speculators export), one folder per variant (bf16, fp8,
           shifted_layers, all_tokens_mask, original_responses)
train.py   a drafter trained with speculators' own EAGLE-3 / DFlash code on an export, saved in speculators' format
decode.py  the greedy speculative decoding loop and the target's plain greedy decoding it must equal
measure.py the command: any target, drafter checkpoint and prompts file -> tau per prompt and its summary
quoting.py whether the target quotes the documentation pasted into a held-out prompt (what the drafter's states add)
stamps.py  the cache stamps' digest: a step is redone only when what made it changed
bench.py   `make bench-acceptance`: all of the above, cached step by step, for every variant, algorithm and seed ->
           benchmarks/results/<date>-acceptance.{json,md} (the table in docs/benchmarks.md)
"""

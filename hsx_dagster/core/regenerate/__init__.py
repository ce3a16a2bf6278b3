"""Regenerate the assistant turns of the input conversations with the target model (optional step).

`run.regenerate` drives one resumable run; `openai_backend` talks to OpenAI-compatible servers,
`local_backend` generates in-process; `turns` decides which turns and with what history; `store`
commits the results in parts; `checks` proves every input is accounted for exactly once.
"""

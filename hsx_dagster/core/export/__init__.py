"""Exports for the drafter trainers people use: speculators (vLLM) and SpecForge (SGLang). Dagster-free.

- `mapping`: which stored layers become each trainer's auxiliary layers and its last/target slot, checked
  before anything is written;
- `folder`: an export folder appears whole (renamed from a `.partial` folder) or not at all; a re-run finishes
  an interrupted one;
- `speculators`: the `datasets` folder, `token_freq.pt`, and optionally the plain `file` layout;
- `hs_backend`: the `hsx` hidden-states backend that serves each row's states from our chunks (imported inside
  speculators' environment only: it needs `hs_connectors`);
- `specforge`: SpecForge's offline `.ckpt` files (EAGLE-3 and DFlash layouts).
"""

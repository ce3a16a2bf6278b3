"""The acceptance benchmark (issue #40): drafters trained on our data, measured in real greedy speculative decoding.

train.py    a drafter trained with speculators' own EAGLE-3 / DFlash code on an export, saved in speculators' format
decode.py   the greedy speculative decoding loop and the target's plain greedy decoding it must equal
measure.py  the command: any target, drafter checkpoint and prompts file -> tau per prompt and its summary
"""

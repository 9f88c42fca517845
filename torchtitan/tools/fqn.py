"""Parameter and module names as the model defines them, whatever wraps its blocks.

AC wraps a block as `<name>._checkpoint_wrapped_module` and `torch.compile` as `<name>._orig_mod`,
so the raw names change with the `[activation_checkpoint]` and `[compile]` settings. State dicts,
checkpoints and per-layer metrics key by the clean name, which is the same in every run.
"""

WRAPPER_INFIXES = ("._checkpoint_wrapped_module", "._orig_mod")


def clean_fqn(name: str) -> str:
    """`name` without the AC and compile wrappers' parts (`layers.0._orig_mod.w` -> `layers.0.w`)."""
    for infix in WRAPPER_INFIXES:
        name = name.replace(infix, "")
    return name

"""The model: its config and presets (`config`), ALBERT itself with its heads (`modeling`), model checkpoint files
(`checkpoint`), transformers interop (`interop`, `conversion`) and progressive stacking (`stacking`)."""

"""tbexp's Optuna sweeper for Hydra: `hydra/sweeper=tbexp_optuna`, switched on by `+sweep=NAME` (sweeps/NAME.yaml).

Hydra imports every public module of the `hydra_plugins` namespace when it
starts, for every command, so the public modules here stay light: `config`
(the schema) and `sweeper` (the plugin class). The work happens in the
private modules, imported only when a sweep runs.
"""

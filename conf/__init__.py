"""prmppo's Hydra config, shipped inside the package as `prmppo.conf` (see setup.py).

The YAML beside this file is the config; this file only makes the directory a regular package, so
that every install mode (wheel, `pip install .`, `pip install -e .`) can locate it by name:
`prmppo.config.paths.conf_dir()`. Nothing imports it.
"""

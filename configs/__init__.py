"""YAML configs, shipped inside the wheel as package data: base.yaml and one folder per group."""

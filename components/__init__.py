"""Registered components. Each role is a sub-package; each implementation is one class plus one
YAML file under conf/<role>/ whose `_target_` names it. The pipeline core imports none of them."""

"""The decoding pipeline: entry points (`python -m pipeline`, `.bench`, `.train`, `.report`, ...)."""
from omegaconf import OmegaConf

from pipeline.sweep import job_dir

# sweep job directories named by their overrides (conf/config.yaml: hydra.sweep.subdir)
if not OmegaConf.has_resolver("job_dir"):
    OmegaConf.register_new_resolver("job_dir", job_dir)

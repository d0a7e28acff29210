"""Exceptions of the shared job/tensor library.

- `SpecError`: the submitter's job (job.toml, model.py, dataset) is wrong; the message says what
  to change. Raised on the submitter's machine by `epochmesh.spec` and `epochmesh.packaging`,
  and by `epochmesh.spec.validate_job_spec` wherever a JobSpec arrives over the network.
- `ExportError`: model.py could not be exported with torch.export; a `SpecError`.
- `CodecError`: encoded tensors (a bundle header, its bytes, a compressed tensor) are
  inconsistent or unsafe. Receivers map it to INVALID_ARGUMENT.
- `ProgramError`: an exported program (bytes from the network) is malformed or uses something
  a donor must never load (pickles, native code, Python evaluated at load time, file access).
"""

from __future__ import annotations


class SpecError(ValueError):
    """A job spec, model file or dataset is invalid; the message says what to change."""


class ExportError(SpecError):
    """torch.export could not export model.py's model and loss."""


class CodecError(ValueError):
    """Encoded tensor data is malformed, inconsistent with its header, or not finite."""


class ProgramError(ValueError):
    """An exported program is malformed or contains something a donor must not load."""

"""Bundle storage: fetching a bundle from where `spec.model.bundle` says into a pod's directory
(`exitplan storage-init`, the pods' storage-init container) or into a local cache (`exitplan up`,
cache.py), verifying it against the digests in its bundle.yaml, and uploading one (`exitplan bundle push`). The URI forms are exitplan.api.bundle_source's.
"""

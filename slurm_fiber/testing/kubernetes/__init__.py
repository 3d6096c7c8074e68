"""Test doubles of the Kubernetes control plane: ``fake`` (an in-memory API server with
the real one's rules) and ``realserver`` (a real kube-apiserver and etcd on loopback)."""

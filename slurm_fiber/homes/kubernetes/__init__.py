"""fiberd's home in a Kubernetes grant Pod, where fiberd is the Pod's one container.

This package holds the home's API-facing parts: ``incluster`` (service
account, CA, namespace and the Pod's identity from the downward API),
``api`` (the few calls the home makes: read its own Pod, patch one Pod
status condition, read a ResourceClaim), ``views`` (the API's JSON reduced
to what the home decides on), ``scope`` (scope claims and scope-loss
detection), ``claimdevices`` (a DRA allocation as core Devices),
``reading`` (one poll round: Pod and claims read and judged), ``home``
(``KubernetesHome`` and ``build_kubernetes_home``, which fiberd calls). Its
test doubles (the fake API server, the real-apiserver runner) are in
``slurm_fiber.testing.kubernetes``. ``options`` declares the home's own fiberd
options; importing it (for ``fiberd --help``) loads nothing else of the home.
"""

"""install-cni's repair controller (Istio's ``cni/pkg/repair``): pods that started without their rules.

A pod whose sandbox was created before the istio-cni plugin was chained in (a node reboot, the gap
while install-cni upgrades) has no capture rules, so its ``istio-validation`` init container exits
126 and the pod crash-loops forever. The controller watches the pods of its node and, for each one
that looks broken (:mod:`.detect`), does one of Istio's three things (:mod:`.controller`): programs
the redirect in the running pod's network namespace (found through the host's /proc,
:mod:`.podnetns`), deletes the pod, or labels it. The pods come from list + watch (:mod:`.informer`),
the work goes through a deduplicating queue with Istio's retry budget (:mod:`.queue`), and deletes
and labels are reported as Kubernetes Events (:mod:`.events`).
"""

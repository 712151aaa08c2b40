"""``agentctl proxy-config`` views of an Envoy config dump, as istioctl 1.28 prints them.

istioctl's writers (``istioctl/pkg/writer/envoy/configdump``, ``istioctl/pkg/writer/envoy/clusters``)
read the dump into Go protos and print tables (Go's tabwriter) or the filtered resources as JSON
(golang/protobuf's jsonpb, re-indented by ``encoding/json``) or YAML (``sigs.k8s.io/yaml``). Each
module here has one job: ``messages`` turns Envoy's JSON into what jsonpb would print, ``render`` has
the Go printers, ``gosort`` Go's ``sort.Slice``, and one module per view. See docs/proxy-config.md.
"""

"""A real single-node Kubernetes cluster on this machine (`make k8s-up` / `make k8s-down`), for
applying deploy/k8s as a cluster runs it (tests/k8s).

Every part is upstream's, built or installed here, none a stand-in: etcd, containerd, runc and the
CNI plugins are Debian's packages; kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
kube-proxy and kubectl are built from the k8s.io/kubernetes module, CoreDNS and kube-router (its
NetworkPolicy controller only) from theirs (scripts/k8s/build.sh). No registry serves images here:
the pod sandbox's pause and CoreDNS are images written from their static binaries (`oci`), and
Trillium's are the ones `make images-offline` builds, imported into containerd.

The node's address is its pod bridge's gateway (no dummy interfaces in this kernel), so the API
server, the kubelet and every pod stay on this machine: nothing listens on another address.
"""

module trillium.dev/k8s-probe

go 1.24.0

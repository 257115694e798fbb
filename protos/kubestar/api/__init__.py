"""The custom resources of kubestar.dev/v1alpha1: types shared by the operator, the local
runner (`kubestar train -f`) and the CRDs in the Helm chart (generated from these types)."""

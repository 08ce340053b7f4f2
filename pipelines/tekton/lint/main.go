// tekton-lint validates Tekton Task and Pipeline YAML with Tekton's own Go types and validation code,
// the same checks the Tekton admission webhook runs (the CRDs alone accept any spec).
//
// Usage: tekton-lint FILE...   exit 0 when every document is valid, 1 otherwise.
package main

import (
	"bytes"
	"context"
	"fmt"
	"os"

	v1 "github.com/tektoncd/pipeline/pkg/apis/pipeline/v1"
	"knative.dev/pkg/apis"
	"sigs.k8s.io/yaml"
)

type object interface {
	SetDefaults(context.Context)
	Validate(context.Context) *apis.FieldError
}

func lint(path string) []string {
	data, err := os.ReadFile(path)
	if err != nil {
		return []string{err.Error()}
	}
	var problems []string
	for i, doc := range bytes.Split(data, []byte("\n---")) {
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		var head struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
		}
		if err := yaml.Unmarshal(doc, &head); err != nil {
			problems = append(problems, fmt.Sprintf("%s: document %d: %v", path, i, err))
			continue
		}
		var obj object
		switch {
		case head.APIVersion == "tekton.dev/v1" && head.Kind == "Task":
			obj = &v1.Task{}
		case head.APIVersion == "tekton.dev/v1" && head.Kind == "Pipeline":
			obj = &v1.Pipeline{}
		default:
			problems = append(problems, fmt.Sprintf("%s: document %d: %s %s is not a tekton.dev/v1 Task or Pipeline", path, i, head.APIVersion, head.Kind))
			continue
		}
		// Strict: an unknown or misspelt field is an error, as with kubectl's server-side field validation.
		if err := yaml.UnmarshalStrict(doc, obj); err != nil {
			problems = append(problems, fmt.Sprintf("%s: %s: %v", path, head.Kind, err))
			continue
		}
		ctx := context.Background()
		obj.SetDefaults(ctx)
		if ferr := obj.Validate(ctx); ferr != nil {
			problems = append(problems, fmt.Sprintf("%s: %s: %v", path, head.Kind, ferr))
		}
	}
	return problems
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: tekton-lint FILE...")
		os.Exit(2)
	}
	failed := false
	for _, path := range os.Args[1:] {
		for _, p := range lint(path) {
			fmt.Fprintln(os.Stderr, p)
			failed = true
		}
	}
	if failed {
		os.Exit(1)
	}
	fmt.Println("ok")
}

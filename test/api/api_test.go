// Package api holds the measure of idem's public surface: what a service
// that imports pkg/... can name. Plumbing for one sibling package or for
// idem's own tools lives in internal/, so that the surface stays small
// enough to learn in an afternoon.
package api

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// maxNames is the most exported names pkg/... may have. Raise it only with
// a CHANGELOG line that says what was added and why it must be public.
const maxNames = 293

// TestThePublicSurfaceIsSmall counts the exported names of pkg/...: top-level
// types, functions, variables and constants, plus the exported methods,
// struct fields and interface methods of exported types, outside test files
// and test helper packages (*test).
func TestThePublicSurfaceIsSmall(t *testing.T) {
	names := exportedNames(t, "../../pkg")
	if len(names) > maxNames {
		t.Errorf("pkg/... exports %d names, more than %d:\n%s", len(names), maxNames, strings.Join(names, "\n"))
	}
	t.Logf("pkg/... exports %d names (at most %d)", len(names), maxNames)
}

func exportedNames(t *testing.T, root string) []string {
	t.Helper()
	var names []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != root && strings.HasSuffix(d.Name(), "test") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		pkg, _ := filepath.Rel(root, filepath.Dir(path))
		for _, n := range fileNames(f) {
			names = append(names, pkg+"."+n)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(names)
	return names
}

func fileNames(f *ast.File) []string {
	var out []string
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if !d.Name.IsExported() {
				continue
			}
			if d.Recv == nil {
				out = append(out, d.Name.Name)
				continue
			}
			if recv := receiver(d.Recv.List[0].Type); ast.IsExported(recv) {
				out = append(out, recv+"."+d.Name.Name)
			}
		case *ast.GenDecl:
			for _, s := range d.Specs {
				switch s := s.(type) {
				case *ast.ValueSpec:
					for _, n := range s.Names {
						if n.IsExported() {
							out = append(out, n.Name)
						}
					}
				case *ast.TypeSpec:
					if s.Name.IsExported() {
						out = append(out, s.Name.Name)
						out = append(out, members(s)...)
					}
				}
			}
		}
	}
	return out
}

// receiver names a method's receiver type: T, *T, T[X] and *T[X] are all T.
func receiver(e ast.Expr) string {
	for {
		switch x := e.(type) {
		case *ast.StarExpr:
			e = x.X
		case *ast.IndexExpr:
			e = x.X
		case *ast.IndexListExpr:
			e = x.X
		case *ast.Ident:
			return x.Name
		default:
			return ""
		}
	}
}

// members names the exported fields (embedded ones by their type) or
// interface methods of s. An interface embedded in an interface adds no
// name of its own.
func members(s *ast.TypeSpec) []string {
	var fields *ast.FieldList
	embedded := true
	switch t := s.Type.(type) {
	case *ast.StructType:
		fields = t.Fields
	case *ast.InterfaceType:
		fields, embedded = t.Methods, false
	default:
		return nil
	}
	var out []string
	for _, f := range fields.List {
		for _, n := range f.Names {
			if n.IsExported() {
				out = append(out, s.Name.Name+"."+n.Name)
			}
		}
		if len(f.Names) == 0 && embedded {
			if name := receiver(f.Type); ast.IsExported(name) {
				out = append(out, s.Name.Name+"."+name)
			} else if sel, ok := f.Type.(*ast.SelectorExpr); ok {
				out = append(out, s.Name.Name+"."+sel.Sel.Name)
			}
		}
	}
	return out
}

// TestTheLibraryStandsWithoutThePaymentsApp: nothing under pkg/, its tests
// included, imports the reference payments handler; the library is proven
// on effects of its own (and by examples/orders).
func TestTheLibraryStandsWithoutThePaymentsApp(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "-test", "-f", "{{.ImportPath}}", "github.com/idemhq/idem/pkg/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, p := range strings.Fields(string(out)) {
		if p == "github.com/idemhq/idem/internal/payments" {
			t.Fatal("a package under pkg/ (or its tests) imports internal/payments")
		}
	}
}

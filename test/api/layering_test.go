package api

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestNoArrowRunsBackUp: within each package of pkg/..., no two files
// depend on each other (one names what the other declares, and the other
// the reverse). A package reads from its base files (types, errors) up to
// the ones that use them, and a reader can take its files in that order.
func TestNoArrowRunsBackUp(t *testing.T) {
	err := filepath.WalkDir("../../pkg", func(dir string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		deps := fileDeps(t, dir)
		for a, to := range deps {
			for b := range to {
				if a < b && deps[b][a] {
					t.Errorf("%s: %s and %s depend on each other", dir, a, b)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// fileDeps maps each non-test file of dir to the files whose top-level
// names it uses.
func fileDeps(t *testing.T, dir string) map[string]map[string]bool {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	declaredIn := map[string]string{}
	files := map[string]*ast.File{}
	for _, p := range paths {
		if strings.HasSuffix(p, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		name := filepath.Base(p)
		files[name] = f
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil {
					declaredIn[d.Name.Name] = name
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						declaredIn[s.Name.Name] = name
					case *ast.ValueSpec:
						for _, n := range s.Names {
							if n.Name != "_" {
								declaredIn[n.Name] = name
							}
						}
					}
				}
			}
		}
	}
	deps := map[string]map[string]bool{}
	for name, f := range files {
		deps[name] = map[string]bool{}
		locals := localNames(f)
		ast.Inspect(f, func(n ast.Node) bool {
			switch x := n.(type) {
			case *ast.SelectorExpr:
				// x.Sel is a field, method or another package's name.
				ast.Inspect(x.X, func(m ast.Node) bool {
					if id, ok := m.(*ast.Ident); ok {
						use(deps[name], declaredIn, locals, name, id.Name)
					}
					return true
				})
				return false
			case *ast.Ident:
				use(deps[name], declaredIn, locals, name, x.Name)
			}
			return true
		})
	}
	return deps
}

func use(deps map[string]bool, declaredIn map[string]string, locals map[string]bool, file, ident string) {
	if f, ok := declaredIn[ident]; ok && f != file && !locals[ident] {
		deps[f] = true
	}
}

// localNames are the names a file declares inside functions (variables,
// parameters, results): a local that shares a top-level name of another
// file is not a use of it.
func localNames(f *ast.File) map[string]bool {
	out := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		switch x := n.(type) {
		case *ast.AssignStmt:
			if x.Tok == token.DEFINE {
				for _, l := range x.Lhs {
					if id, ok := l.(*ast.Ident); ok {
						out[id.Name] = true
					}
				}
			}
		case *ast.Field:
			for _, id := range x.Names {
				out[id.Name] = true
			}
		case *ast.ValueSpec:
			// top-level ones are declarations, not locals; harmless here
			// because they map to their own file.
		}
		return true
	})
	return out
}

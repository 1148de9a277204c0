package config

import (
	"fmt"
	"maps"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// Field describes one setting, for --help and the docs.
type Field struct {
	Path    string // yaml path, e.g. redis.done_ttl
	Env     string // environment variable
	Default string
}

// Fields lists every setting with its environment variable and default.
func Fields() []Field { return FieldsOf(Default()) }

// FieldsOf lists every setting of c; Default holds c's value.
func FieldsOf(c Config) []Field {
	var out []Field
	walk(reflect.ValueOf(c), "", func(path, env string, v reflect.Value) {
		out = append(out, Field{Path: path, Env: env, Default: format(v)})
	})
	return out
}

// applyYAML sets the fields named in a YAML document. It goes through the same
// parsers as the environment, so both name a bad value by its yaml path.
func applyYAML(c *Config, doc []byte) error {
	var raw map[string]any
	if err := yaml.Unmarshal(doc, &raw); err != nil {
		return err
	}
	flat := map[string]any{}
	flatten(raw, "", flat)
	var err error
	walk(reflect.ValueOf(c).Elem(), "", func(path, _ string, v reflect.Value) {
		val, ok := flat[path]
		if !ok || err != nil {
			return
		}
		delete(flat, path)
		if val == nil {
			err = fmt.Errorf("%s: empty value", path)
			return
		}
		if e := set(v, fmt.Sprint(val)); e != nil {
			err = fmt.Errorf("%s: %w", path, e)
		}
	})
	if err != nil {
		return err
	}
	for path := range flat {
		return fmt.Errorf("%s: unknown setting (see 'idem config')", path)
	}
	return nil
}

func flatten(m map[string]any, prefix string, out map[string]any) {
	for k, v := range m {
		path := k
		if prefix != "" {
			path = prefix + "." + k
		}
		if sub, ok := v.(map[string]any); ok {
			flatten(sub, path, out)
			continue
		}
		out[path] = v
	}
}

// OtherVariables are IDEM_* variables that are not settings: the crash-point
// and chaos test hooks. Every other IDEM_* variable must name a setting.
var OtherVariables = []string{"IDEM_CRASH_AT", "IDEM_CRASH_AFTER", "IDEM_CHAOS_SEED", "IDEM_CONSOLE_TOKEN"}

func applyEnv(c *Config, environ []string) error {
	vars := map[string]string{}
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok {
			vars[k] = v
		}
	}
	known := map[string]bool{}
	var err error
	walk(reflect.ValueOf(c).Elem(), "", func(path, env string, v reflect.Value) {
		known[env] = true
		s := vars[env]
		if s == "" || err != nil {
			return
		}
		if e := set(v, s); e != nil {
			err = fmt.Errorf("config: %s (from %s): %w", path, env, e)
		}
	})
	if err != nil {
		return err
	}
	for _, k := range slices.Sorted(maps.Keys(vars)) {
		if strings.HasPrefix(k, "IDEM_") && !known[k] && !slices.Contains(OtherVariables, k) {
			return fmt.Errorf("config: %s names no setting (a misspelling?); 'idem config' lists every variable", k)
		}
	}
	return nil
}

// walk calls fn for every leaf field of v with its yaml path and env name.
func walk(v reflect.Value, prefix string, fn func(path, env string, v reflect.Value)) {
	t := v.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue // derived from the settings, not one of them
		}
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		path := name
		if prefix != "" {
			path = prefix + "." + name
		}
		if f.Type.Kind() == reflect.Struct {
			walk(v.Field(i), path, fn)
			continue
		}
		env := f.Tag.Get("env")
		if env == "" {
			env = "IDEM_" + strings.ToUpper(strings.ReplaceAll(path, ".", "_"))
		}
		fn(path, env, v.Field(i))
	}
}

var durationType = reflect.TypeFor[time.Duration]()

// set parses s into v. Its errors are sentences that quote the value, not
// strconv's own text.
func set(v reflect.Value, s string) error {
	if v.Type() == durationType {
		d, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("%q is not a duration; write one such as 250ms, 5s, 10m or 720h", s)
		}
		v.SetInt(int64(d))
		return nil
	}
	switch v.Kind() {
	case reflect.String:
		v.SetString(s)
	case reflect.Float64:
		f, err := strconv.ParseFloat(s, 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			return fmt.Errorf("%q is not a number; write one such as 0.5", s)
		}
		v.SetFloat(f)
	case reflect.Bool:
		b, err := strconv.ParseBool(s)
		if err != nil {
			return fmt.Errorf("%q is not a boolean; write true or false", s)
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int32, reflect.Int64, reflect.Uint32:
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return fmt.Errorf("%q is not a whole number", s)
		}
		lo, hi := int64(math.MinInt32), int64(math.MaxInt32)
		if v.Kind() == reflect.Uint32 {
			lo, hi = 0, math.MaxUint32
		}
		if n < lo || n > hi {
			return fmt.Errorf("%d is far out of range", n)
		}
		if v.Kind() == reflect.Uint32 {
			v.SetUint(uint64(n))
		} else {
			v.SetInt(n)
		}
	default:
		return fmt.Errorf("unsupported type %s", v.Type())
	}
	return nil
}

func format(v reflect.Value) string {
	if v.Type() == durationType {
		return time.Duration(v.Int()).String()
	}
	if v.Kind() == reflect.String && v.String() == "" {
		return `""`
	}
	return fmt.Sprint(v.Interface())
}

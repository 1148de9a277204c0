package config

import (
	"fmt"
	"reflect"
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

func applyEnv(c *Config, getenv func(string) string) error {
	var err error
	walk(reflect.ValueOf(c).Elem(), "", func(path, env string, v reflect.Value) {
		s := getenv(env)
		if s == "" || err != nil {
			return
		}
		if e := set(v, s); e != nil {
			err = fmt.Errorf("config: %s (from %s=%q): %w", path, env, s, e)
		}
	})
	return err
}

// walk calls fn for every leaf field of v with its yaml path and env name.
func walk(v reflect.Value, prefix string, fn func(path, env string, v reflect.Value)) {
	t := v.Type()
	for i := range t.NumField() {
		f := t.Field(i)
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

func set(v reflect.Value, s string) error {
	if v.Type() == durationType {
		d, err := time.ParseDuration(s)
		if err != nil {
			return err
		}
		v.SetInt(int64(d))
		return nil
	}
	switch v.Kind() {
	case reflect.String:
		v.SetString(s)
	case reflect.Bool:
		b, err := strconv.ParseBool(s)
		if err != nil {
			return err
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int32, reflect.Int64:
		n, err := strconv.ParseInt(s, 10, v.Type().Bits())
		if err != nil {
			return err
		}
		v.SetInt(n)
	case reflect.Uint32:
		n, err := strconv.ParseUint(s, 10, 32)
		if err != nil {
			return err
		}
		v.SetUint(n)
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

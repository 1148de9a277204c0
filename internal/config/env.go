package config

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"
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

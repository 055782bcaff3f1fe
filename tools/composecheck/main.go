// composecheck loads a docker-compose file with the real Compose loader
// (github.com/compose-spec/compose-go/v2, the library `docker compose` itself uses), checks that
// every file it references exists, and prints the resolved project as JSON. No Docker engine needed.
//
//	composecheck check [-profiles sim,load] docker-compose.yml
//	    Loads the file with the given profiles ("*" = every profile, the default) and the .env next
//	    to it (not the caller's environment, so the result is reproducible), then checks build
//	    contexts, Dockerfiles and bind-mount sources exist. Prints
//	    {"project": <resolved project>, "enabled": [services], "missing": [problems]} and exits 1
//	    when something is missing.
//	composecheck yaml2json FILE...
//	    Prints every YAML document of the files as one JSON array (for tests without a YAML library).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"
	"gopkg.in/yaml.v3"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "check":
		err = check(os.Args[2:])
	case "yaml2json":
		err = yaml2json(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "composecheck:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: composecheck check [-profiles a,b] FILE | composecheck yaml2json FILE...")
	os.Exit(2)
}

func check(args []string) error {
	fs := flag.NewFlagSet("check", flag.ExitOnError)
	profiles := fs.String("profiles", "*", "comma-separated profiles to enable (\"*\" = all)")
	_ = fs.Parse(args)
	if fs.NArg() != 1 {
		usage()
	}
	file, err := filepath.Abs(fs.Arg(0))
	if err != nil {
		return err
	}
	dir := filepath.Dir(file)
	opts, err := cli.NewProjectOptions(
		[]string{file},
		cli.WithWorkingDirectory(dir),
		cli.WithDotEnv,
		cli.WithProfiles(strings.Split(*profiles, ",")),
		cli.WithResolvedPaths(true),
		cli.WithConsistency(true),
	)
	if err != nil {
		return err
	}
	project, err := cli.ProjectFromOptions(context.Background(), opts)
	if err != nil {
		return fmt.Errorf("compose loader: %w", err)
	}

	var missing []string
	exists := func(what, path string, dir bool) {
		st, err := os.Stat(path)
		switch {
		case err != nil:
			missing = append(missing, fmt.Sprintf("%s: %s does not exist", what, path))
		case dir && !st.IsDir():
			missing = append(missing, fmt.Sprintf("%s: %s is not a directory", what, path))
		case !dir && st.IsDir():
			missing = append(missing, fmt.Sprintf("%s: %s is a directory", what, path))
		}
	}
	names := project.ServiceNames()
	sort.Strings(names)
	for _, name := range names {
		s := project.Services[name]
		if s.Build != nil {
			exists(name+" build.context", s.Build.Context, true)
			if s.Build.DockerfileInline == "" {
				df := s.Build.Dockerfile
				if df == "" {
					df = "Dockerfile"
				}
				if !filepath.IsAbs(df) {
					df = filepath.Join(s.Build.Context, df)
				}
				exists(name+" build.dockerfile", df, false)
			}
		}
		if s.Image == "" && s.Build == nil {
			missing = append(missing, name+": neither image nor build")
		}
		for _, v := range s.Volumes {
			switch v.Type {
			case types.VolumeTypeBind:
				st, err := os.Stat(v.Source)
				if err != nil {
					missing = append(missing, fmt.Sprintf("%s volume: bind source %s does not exist", name, v.Source))
				} else if st.IsDir() && strings.HasSuffix(v.Target, ".yaml") {
					missing = append(missing, fmt.Sprintf("%s volume: bind source %s is a directory mounted on a file path", name, v.Source))
				}
			case types.VolumeTypeVolume:
				if _, ok := project.Volumes[v.Source]; !ok {
					missing = append(missing, fmt.Sprintf("%s volume: named volume %s is not declared", name, v.Source))
				}
			}
		}
		for dep := range s.DependsOn {
			if _, ok := project.Services[dep]; !ok && s.DependsOn[dep].Required {
				missing = append(missing, fmt.Sprintf("%s depends_on %s: no such enabled service", name, dep))
			}
		}
	}
	raw, err := project.MarshalJSON()
	if err != nil {
		return err
	}
	out, err := json.MarshalIndent(struct {
		Project json.RawMessage `json:"project"`
		Enabled []string        `json:"enabled"`
		Missing []string        `json:"missing"`
	}{raw, names, append([]string{}, missing...)}, "", "  ")
	if err != nil {
		return err
	}
	fmt.Println(string(out))
	if len(missing) > 0 {
		return fmt.Errorf("%d problem(s):\n  %s", len(missing), strings.Join(missing, "\n  "))
	}
	return nil
}

func yaml2json(files []string) error {
	if len(files) == 0 {
		usage()
	}
	docs := []any{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		dec := yaml.NewDecoder(bytes.NewReader(data))
		for {
			var doc any
			err := dec.Decode(&doc)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return fmt.Errorf("%s: %w", f, err)
			}
			if doc != nil {
				docs = append(docs, doc)
			}
		}
	}
	out, err := json.MarshalIndent(docs, "", "  ")
	if err != nil {
		return err
	}
	fmt.Println(string(out))
	return nil
}
